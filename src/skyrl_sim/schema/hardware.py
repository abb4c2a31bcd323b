"""Hardware profiles: how fast one device computes, moves memory, talks to its peers and writes checkpoints.

A profile is a YAML data file. The shipped ones live in ``src/skyrl_sim/data/hardware/`` (``h100``, ``h200``, ``cpu``) and
an endpoint names one in ``hardware.profile``; a path to a profile file works too (``hardware.profile:
calib/h200-fitted.yaml``), which is how a calibrated profile (efficiencies fitted from real runs) reaches the
simulator. Peaks are datasheet or measured numbers; the ``efficiency`` coefficients say what fraction of each peak
the stack really reaches, and the ``overheads`` are fixed costs per op, micro-batch, call, row and single request.
Both are calibration inputs with sane defaults. A profile file written by ``skyrl-sim calibrate`` (schema
``skyrl-sim/profile/1``: a ``base`` profile and ``time_coefficients``, a factor per time-model feature) loads as its
base profile with those factors applied.
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.schema.command_files import note_input
from skyrl_sim.schema.documents import read_yaml, validation_error
from skyrl_sim.schema.strict import Strict

CALIBRATED_SCHEMA = "skyrl-sim/profile/1"
"""What ``skyrl-sim calibrate`` writes: a base profile plus fitted time coefficients (see skyrl_sim.commands.calibrate)."""


class Efficiency(Strict):
    """Achieved fraction of each peak (calibration inputs)."""

    matmul: float = Field(0.6, gt=0, le=1, description="GEMMs, as a fraction of peak_flops")
    attention: float = Field(0.45, gt=0, le=1, description="attention cores (flash / chunked DeltaNet kernels)")
    memory: float = Field(0.8, gt=0, le=1, description="elementwise kernels and weight streaming, of memory_bandwidth")
    interconnect: float = Field(0.7, gt=0, le=1, description="collectives, of interconnect_bandwidth")
    host: float = Field(0.8, gt=0, le=1, description="host-device copies of adapter slots, of host_bandwidth")


class Overheads(Strict):
    """Fixed costs that do not scale with FLOPs or bytes."""

    op_s: float = Field(6e-6, ge=0, description="per op per micro-batch: kernel launch and dispatch")
    microbatch_s: float = Field(2e-3, ge=0, description="per micro-batch: schedule bookkeeping")
    call_s: float = Field(0.05, ge=0, description="per forward_backward / forward call: dispatch and gather")
    row_s: float = Field(2e-4, ge=0, description="per datum row of a call: conversion and result write")
    sample_call_s: float = Field(0.02, ge=0, description="per sample call: router round trip and scheduling")
    vllm_step_s: float = Field(
        2e-3, ge=0, description="per vLLM engine step: scheduling, input preparation, sampling on the host"
    )
    singles_s: dict[str, float] = Field(default_factory=dict, description="fixed part of each single request type")
    swap_s: float = Field(1e-3, ge=0, description="per adapter swap: its barriers, stream syncs and per-tensor copies")
    register_adapter_s: float = Field(
        0.05, ge=0, description="a create_model that only registers an adapter: dispatch and the slot's allocation"
    )

    def single(self, request_type: str) -> float:
        return self.singles_s.get(request_type, 0.0)


class HardwareProfile(Strict):
    """One device type: its memory, peaks, achieved efficiencies, and fixed overheads.

    The memory is the card's: an endpoint that names the profile and no ``hardware.device_memory_gib`` gets
    ``device_memory_gib``, and one with no ``hardware.reserve_gib`` gets ``reserve_gib`` (the CUDA context and the
    workspaces outside PyTorch's allocator). ``sources`` names the public source of each number (docs/hardware.md)."""

    name: str
    description: str = ""
    device_memory_gib: float = Field(
        ..., gt=0, description="memory per device as PyTorch reports it (torch.cuda.get_device_properties().total_memory)"
    )
    cuda_context_gib: float = Field(
        0.0, ge=0, description="the CUDA context and the kernel modules it loads: outside PyTorch's allocator"
    )
    workspaces_gib: float = Field(
        0.0, ge=0, description="NCCL buffers and cuBLAS / TransformerEngine workspaces: outside PyTorch's allocator"
    )
    peak_flops: float = Field(..., gt=0, description="dense FLOP/s per device at the stack's dtype (bf16 on GPUs)")
    peak_flops_fp8: float | None = Field(
        None, gt=0, description="dense fp8 FLOP/s per device; null: the card has no fp8 tensor cores"
    )
    memory_bandwidth: float = Field(..., gt=0, description="device memory bytes/s")
    interconnect_bandwidth: float = Field(..., gt=0, description="bytes/s one way per device between TP peers")
    interconnect_latency_s: float = Field(1e-5, ge=0, description="per collective step")
    storage_bandwidth: float = Field(2e9, gt=0, description="checkpoint read/write bytes/s")
    host_bandwidth: float = Field(
        32e9, gt=0, description="bytes/s one way between host memory and a device (adapter swaps; PCIe Gen4 x16 default)"
    )
    shared_by_devices: bool = Field(False, description="peaks are the machine's, split between an endpoint's devices")
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="the torch device type: which kernels run (their workspaces) and whose OOM message is seen"
    )
    efficiency: Efficiency = Field(default_factory=Efficiency)
    overheads: Overheads = Field(default_factory=Overheads)
    time_coefficients: dict[str, float] = Field(
        default_factory=dict, description="calibrated factor per time-model feature (matmul_s, memory_s, ...); 1 if absent"
    )
    sources: dict[str, str] = Field(
        default_factory=dict, description="the public source of each number, by field name (docs/hardware.md shows them)"
    )

    @property
    def reserve_gib(self) -> float:
        """Memory outside PyTorch's allocator per device when the endpoint does not say: the CUDA context and the
        workspaces (``hardware.reserve_gib``'s default)."""
        return self.cuda_context_gib + self.workspaces_gib

    def share(self, devices: int) -> float:
        """Fraction of the peaks one device gets (1 unless the profile's peaks are shared by the devices)."""
        return 1.0 / devices if self.shared_by_devices else 1.0

    @property
    def flops_matmul(self) -> float:
        return self.peak_flops * self.efficiency.matmul

    @property
    def flops_attention(self) -> float:
        return self.peak_flops * self.efficiency.attention

    @property
    def bytes_memory(self) -> float:
        return self.memory_bandwidth * self.efficiency.memory

    @property
    def bytes_interconnect(self) -> float:
        return self.interconnect_bandwidth * self.efficiency.interconnect

    @property
    def bytes_host(self) -> float:
        return self.host_bandwidth * self.efficiency.host


def shipped_profiles() -> list[str]:
    """Names of the profiles that ship with skyrl-sim."""
    folder = resources.files("skyrl_sim") / "data" / "hardware"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _is_path(ref: str) -> bool:
    return ref.endswith((".yaml", ".yml")) or "/" in ref


def base_ref_beside(base: str, profile_path: Path) -> str:
    """``base`` (a profile name, or a path from the working directory) as a calibrated profile written at
    ``profile_path`` names it: a name stays a name; a path becomes relative to that file's folder, which the loader
    looks in first (``_calibrated``), so the pair works from any folder and on any machine."""
    if not _is_path(base) or not Path(base).exists():
        return base
    return os.path.relpath(Path(base).resolve(), profile_path.absolute().parent.resolve())


@lru_cache(maxsize=64)
def profile_device(ref: str) -> str:
    """The torch device type (``cuda`` or ``cpu``) of a profile name or file (cached: the memory walk asks per shape)."""
    return load_profile(ref).device


def load_profile(ref: str) -> HardwareProfile:
    """A shipped profile by name, or a profile file by path. Errors name the file, the key and the reason. Every file
    it reads (a calibrated profile's base too) is noted as an input of the running command, parsed or cached."""
    profile, files = _profile_and_files(ref)
    for path in files:
        note_input(path, "the hardware profile")
    return profile


def _profile_and_files(ref: str) -> tuple[HardwareProfile, tuple[str, ...]]:
    """The profile ``ref`` names and every file it was read from (its own, then its base's)."""
    if _is_path(ref):
        path = Path(ref)
        if not path.exists():
            raise UserError(f"hardware.profile '{ref}': no such profile file (shipped: {', '.join(shipped_profiles())})")
    else:
        path = Path(str(resources.files("skyrl_sim") / "data" / "hardware" / f"{ref}.yaml"))
        if not path.exists():
            raise UserError(
                f"hardware.profile '{ref}': unknown profile (shipped: {', '.join(shipped_profiles())}; "
                "or give a path to a profile YAML file)"
            )
    try:
        info = path.stat()
    except OSError as exc:
        raise UserError(f"hardware.profile '{ref}': cannot read {path}: {exc.strerror}") from None
    return _parsed_profile(str(path), info.st_mtime_ns, info.st_size)


@lru_cache(maxsize=64)
def _parsed_profile(path_text: str, mtime_ns: int, size: int) -> tuple[HardwareProfile, tuple[str, ...]]:
    """A profile file parsed once per version of the file (its path, modification time and size are the key): every
    variant of a scenario and every call's time model ask for it, and parsing the YAML each time was most of what a
    1,000-variant check did. Callers copy before changing a profile (``model_copy``), so one object can be shared."""
    path = Path(path_text)
    # Profiles load while a run is under way (inside simpy processes and sweep workers, which rebuild exceptions from
    # their message alone): every problem is raised as a plain UserError carrying the file, key and reason.
    try:
        data = read_yaml(path, role="the hardware profile")
        if data.get("schema") == CALIBRATED_SCHEMA:
            return _calibrated(path, data)
        try:
            return HardwareProfile.model_validate(data), (path_text,)
        except ValidationError as exc:
            raise validation_error(str(path), "", exc) from None
    except ScenarioError as exc:
        raise UserError(str(exc)) from None


def _calibrated(path: Path, data: dict[str, Any]) -> tuple[HardwareProfile, tuple[str, ...]]:
    """A profile ``skyrl-sim calibrate`` wrote: its base profile (by name, or a path beside it) with the fitted
    coefficients per time-model feature."""
    base = str(data.get("base") or "")
    if not base or "," in base:
        raise ScenarioError(str(path), "base", f"needs exactly one base profile name, got {base!r}")
    coefficients = data.get("time_coefficients")
    if not isinstance(coefficients, dict) or not all(isinstance(v, (int, float)) for v in coefficients.values()):
        raise ScenarioError(str(path), "time_coefficients", "must map feature names to numbers")
    beside = path.parent / base
    profile, files = _profile_and_files(str(beside) if _is_path(base) and beside.exists() else base)
    name = str(data.get("name") or path.stem)
    coefficients = {k: float(v) for k, v in coefficients.items()}
    return profile.model_copy(update={"name": name, "time_coefficients": coefficients}), (str(path), *files)
