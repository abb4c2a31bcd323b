"""The plugin host: loads built-in and third-party plugins, refuses duplicate names, and runs variants.

Plugins come from the ``skyrl_sim`` entry-point group (the built-ins are registered there too, by this package's
pyproject) and from ``register``. ``SKYRL_SIM_DISABLE_PLUGINS=name,name`` skips entry points by name, which keeps a
broken third-party plugin from taking the CLI down.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from skyrl_sim import __version__
from skyrl_sim.engine.jax_padding import JAX
from skyrl_sim.engine.shapes import FSDP, MEGATRON, PaddingRule
from skyrl_sim.errors import PluginError, UserError
from skyrl_sim.plugin_host import hookspecs
from skyrl_sim.plugin_host.costs import MemoryModel, TimeModel
from skyrl_sim.plugin_host.hookspecs import BackendOptions, BackendSpec, RunContext
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.options import validate_options
from skyrl_sim.schema.skyrl_versions import pr_setting_notes
from skyrl_sim.schema.variant import ResolvedVariant

BACKEND_EXTRAS: dict[str, str] = {"megatron": "real", "tinker": "tinker"}
"""The optional extra (``pip install 'skyrl-sim[EXTRA]'``) each built-in backend needs."""


class _CorePlugin:
    """The host's own padding rules, one per training stack SkyRL has (Megatron, FSDP, JAX), registered like any
    plugin's: an endpoint's ``trainer.strategy`` resolves whichever backend plugins are installed or disabled."""

    @hookspecs.hookimpl
    def skyrl_sim_padding_rules(self) -> list[PaddingRule]:
        return [MEGATRON, FSDP, JAX]


@dataclass
class PluginInfo:
    """One loaded plugin: its name, where it came from, and what it provides."""

    name: str
    source: str
    backends: list[str] = field(default_factory=list)
    padding_rules: list[str] = field(default_factory=list)
    options: list[BackendOptions] = field(default_factory=list)


class PluginHost:
    """Owns the pluggy manager and the name → provider tables."""

    def __init__(self, load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.sources: dict[str, str] = {}
        self.register(_CorePlugin(), "core", "skyrl_sim (built in)")
        if load_entry_points:
            self._load_entry_points()
        self._collect_all()

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def register(self, plugin: object, name: str, source: str = "registered in code") -> None:
        if self.pm.has_plugin(name):
            raise PluginError(f"two plugins are named '{name}' ({self.sources[name]} and {source})")
        self.pm.register(plugin, name=name)
        self.sources[name] = source
        if hasattr(self, "backends"):
            self._collect_all()

    def _collect_all(self) -> None:
        self.backends, self.padding_rules = self._collect()
        self.options = self._collect_options()

    def _load_entry_points(self) -> None:
        disabled = {n.strip() for n in os.environ.get("SKYRL_SIM_DISABLE_PLUGINS", "").split(",") if n.strip()}
        for ep in sorted(metadata.entry_points(group=hookspecs.PROJECT), key=lambda e: e.name):
            if ep.name in disabled:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a third-party plugin that fails to import must not hide the others
                raise PluginError(
                    f"plugin '{ep.name}' ({ep.value}) failed to load: {type(exc).__name__}: {exc}. "
                    f"Set SKYRL_SIM_DISABLE_PLUGINS={ep.name} to skip it."
                ) from None
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else ""
            self.register(plugin, ep.name, f"entry point {ep.value} ({dist} {version})".strip())

    def _plugin_name(self, impl: pluggy.HookImpl) -> str:
        return self.pm.get_name(impl.plugin) or repr(impl.plugin)

    def _collect(self) -> tuple[dict[str, tuple[BackendSpec, str]], dict[str, tuple[PaddingRule, str]]]:
        backends: dict[str, tuple[BackendSpec, str]] = {}
        rules: dict[str, tuple[PaddingRule, str]] = {}
        for impl in self.pm.hook.skyrl_sim_backends.get_hookimpls():
            owner = self._plugin_name(impl)
            for spec in impl.function() or []:
                if spec.name in backends:
                    raise PluginError(
                        f"backend name '{spec.name}' is claimed by two plugins: '{backends[spec.name][1]}' "
                        f"({self.sources.get(backends[spec.name][1], '?')}) and '{owner}' ({self.sources.get(owner, '?')})"
                    )
                backends[spec.name] = (spec, owner)
        for impl in self.pm.hook.skyrl_sim_padding_rules.get_hookimpls():
            owner = self._plugin_name(impl)
            for rule in impl.function() or []:
                if rule.name in rules:
                    raise PluginError(
                        f"padding rule '{rule.name}' is claimed by two plugins: '{rules[rule.name][1]}' and '{owner}'"
                    )
                rules[rule.name] = (rule, owner)
        return backends, rules

    def _collect_options(self) -> dict[str, tuple[BackendOptions, str]]:
        declared: dict[str, tuple[BackendOptions, str]] = {}
        for impl in self.pm.hook.skyrl_sim_backend_options.get_hookimpls():
            owner = self._plugin_name(impl)
            for options in impl.function() or []:
                if options.backend not in self.backends:
                    raise PluginError(
                        f"plugin '{owner}' declares options for backend '{options.backend}', which no plugin provides"
                    )
                if options.backend in declared:
                    raise PluginError(
                        f"options of backend '{options.backend}' are declared by two plugins: "
                        f"'{declared[options.backend][1]}' and '{owner}'"
                    )
                declared[options.backend] = (options, owner)
        return declared

    def backend_options(self, name: str) -> BackendOptions:
        """What backend ``name`` declares it reads (no options, every setting applied, when it declares nothing)."""
        found = self.options.get(name)
        return found[0] if found else BackendOptions(name)

    def check_run(self, variant: ResolvedVariant, backend: str, options: dict[str, str] | None = None) -> None:
        """Refuse, before anything runs, an option the backend does not declare, a value its schema refuses, and an
        override of a setting the backend would ignore (``check_settings``)."""
        if backend not in self.backends:
            self.backend(backend)  # the error that lists the loaded backends
        declared = self.backend_options(backend)
        validate_options(backend, declared.schema, options or {})
        spec = variant.scenario.variants.get(variant.variant_name)
        self.check_settings(backend, variant.source, variant.variant_name, spec.set if spec else {}, variant.overrides)

    def check_settings(
        self, backend: str, source: str, variant: str, variant_set: dict[str, Any], overrides: dict[str, Any]
    ) -> None:
        """Refuse an override the backend cannot apply: one in the variant's own ``set:`` (scenario file ``source``)
        or on the command line (``--set``). A black-box backend (``tinker``) drives a service that runs with its own
        engine, trainer and hardware settings, so either would otherwise be dropped without a word."""
        declared = self.backend_options(backend)
        origins = [(f"{source}, variant '{variant}', set key '{k}'", k) for k in variant_set]
        origins += [(f"--set {k}", k) for k in overrides]
        for where, key in origins:
            if not declared.applies(key):
                raise UserError(
                    f"{where}: the {backend} backend cannot apply this setting (it drives a service that runs with "
                    f"its own; it applies: {', '.join(declared.honours or ())}). Change it on the service instead."
                )

    def cost_models(self) -> tuple[TimeModel, MemoryModel]:
        """The simulator's time and memory models, from whichever plugin answers ``skyrl_sim_cost_models``."""
        models = self.hook.skyrl_sim_cost_models()
        if models is None:
            raise PluginError("no loaded plugin provides the simulator's cost models (skyrl_sim_cost_models)")
        return models

    def plugins(self) -> list[PluginInfo]:
        infos = {name: PluginInfo(name, source) for name, source in self.sources.items()}
        for backend, (_, owner) in self.backends.items():
            infos[owner].backends.append(backend)
        for rule, (_, owner) in self.padding_rules.items():
            infos[owner].padding_rules.append(rule)
        for options, owner in self.options.values():
            infos[owner].options.append(options)
        return list(infos.values())

    def backend(self, name: str) -> hookspecs.Backend:
        if name not in self.backends:
            raise UserError(f"no backend named '{name}' (loaded: {', '.join(sorted(self.backends)) or 'none'})")
        try:
            return self.backends[name][0].factory()
        except ImportError as exc:  # a backend whose optional dependencies are not installed
            extra = BACKEND_EXTRAS.get(name)
            install = f"pip install 'skyrl-sim[{extra}]'" if extra else "install the packages its plugin needs"
            if name == "megatron":
                install = (
                    "pip install torch==2.13.0, then pip install -c constraints.txt 'skyrl-sim[real]' "
                    "(see docs/getting-started.md)"
                )
            raise UserError(
                f"--backend {name}: needs '{exc.name or exc}', which is not installed; {install}"
            ) from None

    def padding_rule(self, name: str) -> PaddingRule:
        if name not in self.padding_rules:
            raise UserError(
                f"endpoint trainer.strategy '{name}' has no padding rule (known: {', '.join(sorted(self.padding_rules))})"
            )
        return self.padding_rules[name][0]

    def run(
        self,
        variant: ResolvedVariant,
        backend: str,
        options: dict[str, str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> RunResult:
        """Run one variant on a backend, with the run hooks around it; ``progress`` is told the requests done so far
        (``RunContext.progress``)."""
        strategy = variant.endpoint.trainer.strategy
        if strategy not in self.padding_rules:
            raise UserError(
                f"{variant.endpoint_source or variant.source}, key 'trainer.strategy': '{strategy}' has no padding rule "
                f"(known: {', '.join(sorted(self.padding_rules))})"
            )
        self.check_run(variant, backend, options)
        impl = self.backend(backend)
        self.hook.skyrl_sim_run_started(variant=variant, backend=backend)
        result = impl.run(variant, RunContext(host=self, options=options or {}, progress=progress))
        result.versions = {**self.versions(backend), **result.versions}
        result.notes += pr_setting_notes(variant.endpoint.skyrl_version, variant.endpoint.engine)
        result.notes += variant.endpoint.assumptions
        self.hook.skyrl_sim_run_finished(result=result)
        return result

    def versions(self, backend: str) -> dict[str, str]:
        """What a RunResult is stamped with: skyrl-sim, Python, and the plugin that ran it (with its package)."""
        owner = self.backends[backend][1] if backend in self.backends else "?"
        return {
            "skyrl-sim": __version__,
            "python": platform.python_version(),
            "plugin": f"{owner}: {self.sources.get(owner, '?')}",
        }
