"""``skyrl-sim endpoints`` (list, show, from-skyrl) and ``skyrl-sim schema``: what ships, and the file formats.

``endpoints list`` shows every endpoint a scenario can name (the shipped ones, and ``./scenarios/endpoints``);
``endpoints show NAME|PATH`` prints one endpoint with every default filled in, as the simulator reads it;
``endpoints from-skyrl`` writes the endpoint of a SkyRL launch (``from_skyrl``).
``schema scenario|endpoint`` prints the JSON Schema of a scenario or endpoint file (point an editor's YAML language
server at it for completion and checks while typing).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.results.outputs import write_stdout
from skyrl_sim.schema.documents import read_yaml, validation_error
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.hardware import shipped_profiles
from skyrl_sim.schema.scenario_spec import Scenario
from skyrl_sim.schema.shipped import endpoints_dir

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def known_endpoints() -> dict[str, Path]:
    """Endpoint names a scenario can use from the current folder, first match wins (as the loader looks them up)."""
    found: dict[str, Path] = {}
    for folder in (Path("scenarios/endpoints"), endpoints_dir()):
        if folder is not None and folder.is_dir():
            for path in sorted(folder.glob("*.yaml")):
                found.setdefault(path.stem, path)
    return found


def load_endpoint_file(ref: str) -> tuple[Endpoint, Path]:
    """An endpoint by name or path, validated; errors name the file, the key and the reason."""
    path = Path(ref)
    if not path.exists():
        known = known_endpoints()
        if ref not in known:
            raise UserError(f"endpoints show: no endpoint '{ref}' (known: {', '.join(known) or 'none'})")
        path = known[ref]
    try:
        return Endpoint.model_validate(read_yaml(path, role="the endpoint file")), path
    except ValidationError as exc:
        raise validation_error(str(path), "", exc) from None


def endpoints_table() -> Table:
    table = Table(title="endpoints", title_justify="left")
    for column in ("name", "model", "hardware", "parallelism", "file"):
        table.add_column(column)
    for name, path in known_endpoints().items():
        try:
            endpoint, _ = load_endpoint_file(str(path))
        except ScenarioError as exc:
            table.add_row(name, "[red]invalid[/red]", exc.reason, "", str(path))
            continue
        hw, par = endpoint.hardware, endpoint.parallelism
        model = endpoint.model if isinstance(endpoint.model, str) else json.dumps(endpoint.model)
        table.add_row(
            name,
            model,
            f"{hw.devices} x {hw.profile}, {hw.device_memory_gib:g} GiB (reserve {hw.reserve_gib:g})",
            f"tp {par.tp} pp {par.pp} cp {par.cp} dp {par.dp} ep {par.ep}",
            str(path),
        )
    return table


def json_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema of a scenario or endpoint file; a scenario's inline endpoint is checked as an endpoint."""
    if kind == "endpoint":
        schema = Endpoint.model_json_schema()
    else:
        schema = Scenario.model_json_schema()
        endpoint = Endpoint.model_json_schema()
        defs = schema.setdefault("$defs", {})
        defs.update(endpoint.pop("$defs", {}))
        defs["Endpoint"] = endpoint
        schema["properties"]["endpoint"] = {
            "anyOf": [
                {"type": "string", "description": "an endpoint name (see `skyrl-sim endpoints list`) or a path"},
                {"$ref": "#/$defs/Endpoint"},
            ]
        }
    return {"$schema": JSON_SCHEMA_DIALECT, **schema, "title": f"skyrl-sim {kind} file"}


def cmd_from_skyrl(args: argparse.Namespace, console: Console) -> int:
    """``endpoints from-skyrl``: the endpoint file, and every key of the backend config mapped or reported."""
    from skyrl_sim.commands.from_skyrl import TINKER_LORA_RANK, convert, parse_backend_config, validated
    from skyrl_sim.results.outputs import Output, check_outputs, write_atomic
    from skyrl_sim.schema.skyrl_versions import DEFAULT_VERSION

    if args.name is not None:
        raise UserError(f"endpoints from-skyrl takes no NAME ('{args.name}'); the endpoint's name is --name NAME")
    if not args.base_model:
        raise UserError("endpoints from-skyrl: --base-model (a local config.json) is required")
    config = parse_backend_config(args.backend_config or "{}")  # an input: read before the output is checked
    check_outputs([Output("--out", args.out)], [("the --base-model config", args.base_model)])
    to_file = args.out is not None and args.out != "-"
    conversion = convert(
        args.base_model,
        args.backend or "megatron",
        config,
        args.gpus,
        gpu=args.gpu,
        device_memory_gib=args.device_memory_gib,
        lora_rank=TINKER_LORA_RANK if args.lora_rank is None else args.lora_rank,
        name=args.endpoint_name,
        skyrl_version=args.skyrl_version or DEFAULT_VERSION,
        relative_to=Path(args.out).absolute().parent if to_file else Path("."),
    )
    endpoint = validated(conversion)
    text = yaml.safe_dump(conversion.endpoint, sort_keys=False)
    report = console if args.out != "-" else Console(stderr=True)
    for line in conversion.report():
        report.print(line, highlight=False, markup=False, soft_wrap=True)
    if args.out:
        write_atomic(args.out, text)
        if args.out != "-":
            report.print(f"endpoint {endpoint.name}: {args.out}", highlight=False, markup=False)
    else:
        console.print(text.rstrip(), highlight=False, markup=False)
    return 0


FROM_SKYRL_FLAGS = {
    "base_model": "--base-model",
    "backend": "--backend",
    "backend_config": "--backend-config",
    "gpus": "--gpus",
    "gpu": "--gpu",
    "device_memory_gib": "--device-memory-gib",
    "lora_rank": "--lora-rank",
    "skyrl_version": "--skyrl-version",
    "endpoint_name": "--name",
    "out": "--out",
}
"""The flags only ``from-skyrl`` reads (argparse destination -> flag): ``list`` and ``show`` refuse them rather than
ignore them."""


def cmd_endpoints(args: argparse.Namespace, console: Console) -> int:
    if args.action == "from-skyrl":
        return cmd_from_skyrl(args, console)
    given = [flag for dest, flag in FROM_SKYRL_FLAGS.items() if getattr(args, dest, None) is not None]
    if given:
        raise UserError(
            f"endpoints {args.action} takes no {', '.join(given)}: {'it is a flag' if len(given) == 1 else 'they are flags'}"
            " of endpoints from-skyrl"
        )
    if args.action == "show":
        if not args.name:
            raise UserError("endpoints show NAME|PATH: give an endpoint name or file")
        endpoint, path = load_endpoint_file(args.name)
        console.print(f"# {path}", highlight=False, markup=False)
        placement = endpoint.placement_line()
        if placement:
            console.print(f"# {placement}", highlight=False, markup=False)
        console.print(yaml.safe_dump(endpoint.model_dump(), sort_keys=False).rstrip(), highlight=False, markup=False)
        return 0
    if args.name:
        raise UserError(f"endpoints list takes no name (did you mean: endpoints show {args.name}?)")
    console.print(endpoints_table())
    return 0


def cmd_schema(args: argparse.Namespace, console: Console) -> int:
    write_stdout(json.dumps(json_schema(args.kind), indent=2).encode())  # a full or closed stdout is one line
    return 0


def add_parser(sub: Any) -> None:
    """``skyrl-sim endpoints`` and ``skyrl-sim schema``: registered by the CLI."""
    p = sub.add_parser("endpoints", help="list the endpoints a scenario can name, or show one with its defaults")
    p.add_argument("action", nargs="?", default="list", choices=["list", "show", "from-skyrl"])
    p.add_argument("name", nargs="?", help="show: an endpoint name or file")
    p.add_argument("--base-model", metavar="CONFIG", help="from-skyrl: the model's local Hugging Face config.json")
    p.add_argument("--backend", choices=["megatron", "fsdp"], help="from-skyrl: SkyRL's --backend (megatron)")
    p.add_argument("--backend-config", metavar="JSON", help="from-skyrl: SkyRL's --backend-config (JSON, or a file)")
    p.add_argument("--gpus", type=int, metavar="N", help="from-skyrl: GPUs the trainer uses (else its placement keys)")
    p.add_argument(
        "--gpu",
        metavar="PROFILE",
        help="from-skyrl: the GPUs' hardware profile, a shipped name (" + ", ".join(shipped_profiles()) + ") or a file; "
        "h200 if not given (the report says so)",
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        metavar="GIB",
        help="from-skyrl: memory PyTorch reports per GPU (else the profile's)",
    )
    p.add_argument("--lora-rank", type=int, metavar="R", help="from-skyrl: the rank clients ask for (32)")
    p.add_argument("--skyrl-version", choices=["0.4.0", "pr1874"], help="from-skyrl: SkyRL's version (0.4.0)")
    p.add_argument("--name", dest="endpoint_name", metavar="NAME", help="from-skyrl: the endpoint's name")
    p.add_argument("--out", metavar="PATH", help="from-skyrl: write the endpoint file here ('-': stdout)")
    p.set_defaults(func=cmd_endpoints)
    s = sub.add_parser("schema", help="print the JSON Schema of scenario or endpoint files (for editors)")
    s.add_argument("kind", nargs="?", default="scenario", choices=["scenario", "endpoint"])
    s.set_defaults(func=cmd_schema)
