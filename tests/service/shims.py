"""Runtime shims that let PyPI ``skyrl==0.4.0`` (Python >= 3.12) serve its Tinker API on this Python 3.11 CPU machine.

Run by the service harness *inside the service's own venv*, never imported by the test process:

    python shims.py api    --host 127.0.0.1 --port P --base-model DIR --backend jax ...   # the API server
    python shims.py engine --base-model DIR --backend jax ...                             # the engine (spawned by the API)

Each shim is the smallest change that was needed (see ../../../shared/notes/cpu-stack.md):

1. ``typing.TypedDict = typing_extensions.TypedDict`` before anything imports skyrl: on 3.11 pydantic refuses
   ``typing.TypedDict`` in models (skyrl.tinker.types.MultiModalKwargs).
2. The API insists on having been launched by ``uv run`` and spawns its engine with ``uv run ... -m skyrl.tinker.engine``;
   ``_build_uv_run_cmd_engine`` is replaced so the engine is spawned with this interpreter through this file, so the
   engine gets the same shims.
3. Observation only (changes nothing the engine decides): before each backend call the engine logs which request ids
   the call holds (``skyrl-sim-shim: call KIND ids=...``), and before each single phase the ids of its singles. SkyRL's
   own lines (``process_batch_requests(KIND, n=K)``) say how many requests a call held, not which; the conformance test
   needs which, request for request.

The API's ``if __name__ == "__main__"`` block is not reachable through ``runpy`` with shim 2 in place, so ``api``
below starts uvicorn with SkyRL's own app, argument parser (``add_model``) and log config.
"""

from __future__ import annotations

import sys
import typing

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]  # shim 1

SHIM_TAG = "skyrl-sim-shim"


def _spawn_engine_with_this_interpreter(parent_cmd: list[str], engine_config: object) -> list[str]:
    """Shim 2: the engine command, without uv."""
    from skyrl.tinker.config import config_to_argv

    return [sys.executable, __file__, "engine", *config_to_argv(engine_config)]  # type: ignore[arg-type]


def _log_call_ids() -> None:
    """Shim 3: log the request ids of every backend call and every single phase (observation only)."""
    from skyrl.tinker.engine import TinkerEngine
    from skyrl.utils.log import logger

    def wrap(name: str, kind: str) -> None:
        original = getattr(TinkerEngine, name)

        def logged(self: object, requests: dict, *args: object, **kwargs: object) -> object:
            logger.info(f"{SHIM_TAG}: call {kind} ids={','.join(str(r) for r in requests)}")
            return original(self, requests, *args, **kwargs)

        setattr(TinkerEngine, name, logged)

    wrap("process_forward_backward", "forward_backward")
    wrap("process_forward", "forward")
    wrap("process_sample", "sample")
    original_singles = TinkerEngine.process_single_requests

    def singles(self: object, requests: dict) -> object:
        if requests:
            logger.info(f"{SHIM_TAG}: singles ids={','.join(str(r) for r in requests)}")
        return original_singles(self, requests)

    TinkerEngine.process_single_requests = singles  # type: ignore[method-assign]


def run_api(argv: list[str]) -> None:
    import argparse

    import uvicorn
    from skyrl.tinker import api
    from skyrl.tinker.config import EngineConfig, add_model
    from skyrl.utils.log import get_uvicorn_log_config

    api._build_uv_run_cmd_engine = _spawn_engine_with_this_interpreter  # shim 2
    parser = argparse.ArgumentParser(description="SkyRL tinker API server (skyrl-sim test harness)")
    add_model(parser, EngineConfig)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields}
    api.app.state.engine_config = EngineConfig.model_validate(fields)
    uvicorn.run(api.app, host=args.host, port=args.port, log_config=get_uvicorn_log_config())


def run_engine(argv: list[str]) -> None:
    from skyrl.tinker import engine

    _log_call_ids()
    sys.argv = [engine.__file__, *argv]
    engine.main()


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    {"api": run_api, "engine": run_engine}[role](rest)
