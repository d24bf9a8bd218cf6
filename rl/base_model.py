"""The run's base model: made by model.make when missing, or model.path checked on the driver
against what both sides serve before anything starts (rl/loop.py's train)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from megamoe.contract import BITWISE
from rl.config import Config
from rl.run_dir import base_model_dir

log = logging.getLogger("megamoe.rl")


def resolve_model(cfg: Config, run_dir: Path) -> Path:
    """The base model's folder: model.path, checked (check_model), or model.make's, made when missing."""
    path = base_model_dir(cfg, run_dir)
    if cfg.model.path is not None:
        check_model(path)
    elif not (path / "config.json").is_file():
        from rl.config import ConfigError
        from rl.make_model import make_model
        from rl.memory_plan import check_host_memory

        try:
            check_host_memory(**dataclasses.asdict(cfg.model.make))
        except ValueError as e:
            raise ConfigError(f"model.make: {e} (or `megamoe-rl make-model` elsewhere and model.path)") from None
        make_model(path, **dataclasses.asdict(cfg.model.make))
        log.info("made a random-initialised model in %s", path)
    if cfg.run.numerics == BITWISE:
        check_bitwise_architecture(path, "model.path" if cfg.model.path is not None else "model.make.arch")
    return path


def check_bitwise_architecture(path: Path, key: str) -> None:
    """run.numerics=bitwise: the model's architecture one whose every op is measured bitwise on both sides
    (rollout.bitwise.ARCHITECTURES); ConfigError naming `key` otherwise."""
    import json

    from rl.config import ConfigError
    from rollout.bitwise import ARCHITECTURES

    archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    if not archs or any(a not in ARCHITECTURES for a in archs):
        raise ConfigError(f"{key}: {str(path)!r} holds a {'/'.join(archs) or 'model without architectures'}; "
                          f"run.numerics=bitwise expects one of {ARCHITECTURES} (the architectures whose every "
                          "op is measured bitwise on both sides, docs/BITWISE.md)")


def check_model(path: Path, key: str = "model.path") -> None:
    """A checkpoint both sides run, read on the driver before anything starts: config.json's
    model_type one the trainer loads (trainer.model.SUPPORTED_ARCHS), its architecture and settings
    ones the rollout hook serves (rollout.archs.check_model_config), every MoE block of the model
    it describes (built on the meta device) one megamoe computes (trainer.experts.
    check_megamoe_eligible: activation, gated experts, no biases, the router), and the weights'
    names and shapes that model's (safetensors headers only). ConfigError naming `key`, the class,
    the model_type and what is not supported."""
    from rl.config import ConfigError

    if not path.is_dir():
        raise ConfigError(f"{key}: no such folder {str(path)!r} (expected a Hugging Face checkpoint folder "
                          f"with config.json and *.safetensors)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: expected a Hugging Face checkpoint folder with config.json, {str(path)!r} has none")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.archs import check_model_config
    from trainer.experts import check_megamoe_eligible
    from trainer.model import SUPPORTED_ARCHS, check_checkpoint

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - whatever transformers says, it is said naming the key
        raise ConfigError(f"{key}: {str(path / 'config.json')!r} does not load ({type(e).__name__}: "
                          f"{' '.join(str(e).split())})") from None
    arch = "/".join(config.architectures) if config.architectures else "model without config.json `architectures`"
    what = f"{key}: {str(path)!r} holds a {arch} (model_type {config.model_type!r})"
    if config.model_type not in SUPPORTED_ARCHS:
        raise ConfigError(f"{what}, which is not a MoE model the trainer trains: expected model_type one of "
                          f"{SUPPORTED_ARCHS}")
    try:
        check_model_config(config, where=what)
        with torch.device("meta"):
            check_megamoe_eligible(AutoModelForCausalLM.from_config(config))
        check_checkpoint(path, config)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        message = " ".join(str(e).split())
        raise ConfigError(message if message.startswith(what) else f"{what}: {message}") from None
