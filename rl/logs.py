"""vLLM's own logs for a run: everything at INFO into a file, WARNING and above on the terminal, once each.

    env = vllm_log_env(run_dir)          # for every vLLM process's environment (rl/loop.py: the actors)
    with vllm_logs_to(out_dir): ...      # the same for vLLM engines made in this process (consistency)

vLLM configures its `vllm` logger from the dictConfig file named by VLLM_LOGGING_CONFIG_PATH (vLLM
0.26 reads it when vllm is imported, 0.32 when an engine is made; both pass it on to the engine
core and worker processes they spawn). The file written here sends INFO and above to
<folder>/vllm.log, appended to by every vLLM process of the run, and WARNING and above to stderr,
each distinct message once for the whole run: a message that any process has shown already (vLLM
repeats its platform warnings in every engine process, and some per weight sync) is not shown
again, and stays in vllm.log. No vLLM file is edited and nothing of vLLM is patched: the file is
vLLM's documented logging seam.

The warning a run's terminal used to show after every weight sync, "RotaryEmbedding: Failed to load
weights" (vLLM 0.32's layerwise reload, model_loader/reload/layerwise.py), is one of these: it is
harmless, because the rotary embedding's only tensor is its cos/sin cache, computed from the config
and never in a checkpoint, so an update has nothing for it and vLLM puts the cache it had back.
It is now shown once; vllm.log keeps every occurrence.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

VLLM_LOG = "vllm.log"
_CONFIG_FILE = ".vllm_logging.json"
_SEEN_FILE = ".vllm_terminal_seen"
_FORMAT = "%(asctime)s vllm pid=%(process)d %(levelname)s [%(filename)s:%(lineno)d] %(message)s"


class OncePerMessage(logging.Filter):
    """Passes each distinct (level, message) once: per process, and across processes when they
    share `seen_file` (one digest per line, appended under an exclusive lock)."""

    def __init__(self, seen_file: str | None = None):
        super().__init__()
        self.seen_file = seen_file
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = hashlib.sha1(f"{record.levelno}:{record.getMessage()}".encode()).hexdigest()[:16]
        if key in self.seen:
            return False
        self.seen.add(key)
        if self.seen_file is None:
            return True
        try:
            with open(self.seen_file, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.seek(0)
                if key in f.read().split():
                    return False
                f.write(key + "\n")
        except OSError:  # the folder went away: fall back to once per process
            pass
        return True


def vllm_logging_config(folder: Path) -> dict:
    """The dictConfig of vLLM's `vllm` logger: INFO to folder/vllm.log, WARNING+ to stderr once each."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _FORMAT}},
        "filters": {"once": {"()": f"{__name__}.OncePerMessage", "seen_file": str(folder / _SEEN_FILE)}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(folder / VLLM_LOG), "level": "INFO",
                     "formatter": "plain"},
            "terminal": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "WARNING",
                         "formatter": "plain", "filters": ["once"]},
        },
        "loggers": {"vllm": {"handlers": ["file", "terminal"], "level": "INFO", "propagate": False}},
    }


def vllm_log_env(folder: Path) -> dict[str, str]:
    """Write the logging config into `folder` (vLLM then logs to folder/vllm.log); the environment
    variables that make vLLM use it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _CONFIG_FILE
    path.write_text(json.dumps(vllm_logging_config(folder), indent=1) + "\n")
    (folder / _SEEN_FILE).unlink(missing_ok=True)  # a resumed run shows its warnings again, once
    return {"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_CONFIG_PATH": str(path)}


def configure_vllm_logging() -> None:
    """Apply the file VLLM_LOGGING_CONFIG_PATH names in this process now (an actor, before it imports
    vLLM): vLLM >= 0.32 applies it only when it makes an engine, and what its modules log at import
    would otherwise reach the terminal through the process's root logger."""
    import logging.config

    path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if path and os.path.isfile(path):
        with open(path) as f:
            logging.config.dictConfig(json.load(f))


@contextlib.contextmanager
def vllm_logs_to(folder: Path):
    """vllm_log_env in this process's environment for the block, applied at once (configure_vllm_logging;
    vLLM 0.26 reads it when imported); yields the log file's path. The environment and the `vllm`
    logger are restored afterwards: the block's handlers are closed and removed, so nothing of this
    process logs into `folder` later (it may be gone: a refused `consistency` removes it)."""
    env = vllm_log_env(folder)
    before = {k: os.environ.get(k) for k in env}
    logger = logging.getLogger("vllm")
    kept = (list(logger.handlers), list(logger.filters), logger.level, logger.propagate)
    os.environ.update(env)
    configure_vllm_logging()
    try:
        yield folder / VLLM_LOG
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for h in logger.handlers:
            if h not in kept[0]:
                h.close()
        logger.handlers[:], logger.filters[:] = kept[0], kept[1]
        logger.setLevel(kept[2])
        logger.propagate = kept[3]


def setup_run_logging(run_dir: Path) -> list[tuple[logging.Logger, logging.Handler]]:
    """train.log (and the terminal) for the megamoe loggers; returns what to remove at the end."""
    fmt = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    fh = logging.FileHandler(run_dir / "train.log")
    fh.setFormatter(fmt)
    root = logging.getLogger("megamoe")
    root.setLevel(logging.INFO)
    root.addHandler(fh)
    added = [(root, fh)]
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in root.handlers):
        sh = logging.StreamHandler()
        sh.setFormatter(fmt)
        root.addHandler(sh)
        added.append((root, sh))
    # The per-step line goes to the file; the progress bar shows it on the terminal.
    steps = logging.getLogger("megamoe.rl.steps")
    steps.propagate = False
    steps.addHandler(fh)
    added.append((steps, fh))
    return added


def close_run_logging(handlers: list[tuple[logging.Logger, logging.Handler]]) -> None:
    for logger, h in handlers:
        logger.removeHandler(h)
        h.close()
