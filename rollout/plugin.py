"""vLLM general plugin: make vLLM's MoE models compute their routed experts with megamoe.

Registered in pyproject.toml under the `vllm.general_plugins` entry point, so vLLM calls
`register()` in every one of its processes (driver, engine core, workers). Configuration comes
from one environment variable that `rollout.worker.RolloutWorker` sets before it creates the
engine, so every process vLLM spawns inherits it:

    MEGAMOE_MOE_IMPL unset      the plugin does nothing: vLLM runs untouched
    MEGAMOE_MOE_IMPL=megamoe    routed experts through megamoe.fused_moe(impl="megamoe")
    MEGAMOE_MOE_IMPL=reference  routed experts through megamoe.fused_moe(impl="reference")
    MEGAMOE_MOE_IMPL=stock      vLLM's own MoE kernels, with the weight-reload repair (adapter.py)

and a second one, MEGAMOE_NUMERICS=bitwise (unset or `fast`: vLLM's own dense kernels), which also
installs the batch-invariant linears and attention of rollout/bitwise.py.

Why this module imports nothing but the standard library: vLLM loads a plugin with
`entry_point.load()` inside `try/except Exception: logger.exception(...)`, so an exception raised
while *importing* this module is logged and swallowed, and the engine would quietly run vLLM's own
MoE. `register()` itself is called outside that try, so everything that can fail (the value of the
variable, importing megamoe and vLLM internals, the registration) happens inside `register()`,
where an exception stops the engine from starting. A second line of defence is in
`rollout.extension`: the worker extension refuses to import when the plugin did not run.
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "MEGAMOE_MOE_IMPL"

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "megamoe"  # pyproject.toml: megamoe = "rollout.plugin:register"

# What register() did in this process; read by rollout.extension (in vLLM's worker process).
STATE: dict[str, object] = {"called": False, "impl": None, "registered": False, "numerics": None}
NUMERICS_ENV_VAR = "MEGAMOE_NUMERICS"


def configured_impl() -> str | None:
    """The validated value of MEGAMOE_MOE_IMPL, or None when it is unset or empty."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return None
    from megamoe.contract import HOST_IMPLS  # here, not at import: see the module docstring

    if value not in HOST_IMPLS:
        raise ValueError(f"{ENV_VAR}: expected one of {HOST_IMPLS} (or unset to leave vLLM alone), "
                         f"got {value!r}")
    return value


def configured_numerics() -> str:
    """The validated value of MEGAMOE_NUMERICS ("fast" when unset or empty)."""
    from megamoe.contract import FAST, NUMERICS  # here, not at import: see the module docstring

    value = os.environ.get(NUMERICS_ENV_VAR, "").strip() or FAST
    if value not in NUMERICS:
        raise ValueError(f"{NUMERICS_ENV_VAR}: expected one of {NUMERICS} (or unset: fast), got {value!r}")
    return value


def entry_point():
    """The installed entry point vLLM will call this plugin through (an importlib.metadata.EntryPoint, not
    loaded); RuntimeError naming what is wrong: VLLM_PLUGINS excluding it, none or several installed."""
    from importlib.metadata import entry_points

    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and ENTRY_POINT_NAME not in [p.strip() for p in allowed.split(",")]:
        raise RuntimeError(f"VLLM_PLUGINS={allowed!r} excludes the {ENTRY_POINT_NAME!r} plugin; vLLM would run its own MoE")
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    if len(found) != 1:
        raise RuntimeError(f"expected one {ENTRY_POINT_NAME!r} entry point in group {ENTRY_POINT_GROUP}, found "
                           f"{len(found)}{': ' + ', '.join(ep.value for ep in found) if found else ''} "
                           "(is the project installed? pip install -e .)")
    return found[0]


def register() -> None:
    """vLLM's entry point. Raises (and so stops engine start-up) when misconfigured or broken."""
    from megamoe.contract import BITWISE, FAST  # here, not at import: see the module docstring

    STATE["called"] = True
    impl = configured_impl()
    numerics = configured_numerics()
    STATE["impl"] = impl
    STATE["numerics"] = numerics
    if impl is None:
        if numerics != FAST:
            raise ValueError(f"{NUMERICS_ENV_VAR}={numerics}: expected {ENV_VAR} set too (the bitwise numerics "
                             "need megamoe's MoE on both sides)")
        return
    from rollout import adapter, bitwise, vllm026  # heavy imports (vLLM internals, megamoe) happen here, loudly

    # Every call: a process that registered for another numerics (or was forked from one) holds them.
    bitwise.apply(numerics == BITWISE)
    if STATE["registered"]:
        return
    adapter.register_moe_method(impl)
    vllm026.register(impl)
    STATE["registered"] = True
    logger.info("megamoe plugin: vLLM MoE layers use moe_impl=%s, numerics=%s in process %d", impl, numerics,
                os.getpid())
