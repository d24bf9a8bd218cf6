"""How a run reports an actor that raised or died: the exceptions the loop raises, the root cause
without Ray's wrapping, and the one paragraph train.log and the terminal get (rl/loop.py)."""

from __future__ import annotations

import re
from pathlib import Path

from rl.run_dir import latest_checkpoint


class ActorError(RuntimeError):
    """An actor raised or died where the run cannot go on; carries what the run's last words need.

    `actor` names it ("TrainerWorker rank 0", "RolloutWorker 1"), `method` the call, `where` the
    point of the run ("step 3", "start, before step 1"); `cause` is Ray's exception, of which
    `root_cause` keeps the type and message of what went wrong inside the actor."""

    def __init__(self, actor: str, method: str, where: str, cause: BaseException, note: str = ""):
        self.actor, self.method, self.where, self.cause, self.note = actor, method, where, cause, note
        self.died = died(cause)
        self.root_type, self.root_message = root_cause(cause)
        super().__init__(f"{actor} {'died' if self.died else 'raised'} in {method} at {where}{note}: "
                         f"{self.root_type}: {self.root_message}")


class TrainerDied(ActorError):
    """A TrainerWorker process is gone; the run ends with the last checkpoint intact."""


class RolloutFailed(ActorError):
    """RolloutWorkers kept dying past rollout.max_restarts."""


def died(e: BaseException) -> bool:
    """The actor's process is gone (killed, crashed), as opposed to its code raising."""
    import ray

    return isinstance(e, ray.exceptions.RayActorError) and not e.actor_init_failed


ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LAST_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*): (.*)$")  # "pkg.ValueError: message"


def root_cause(e: BaseException) -> tuple[str, str]:
    """(type name, message) of what went wrong inside an actor, without Ray's wrapping: the exception
    its method raised; for a constructor that raised, the last line of the traceback Ray keeps as
    text; for a process that died, Ray's exit detail."""
    import ray

    while isinstance(e, ray.exceptions.RayTaskError) and getattr(e, "cause", None) not in (None, e):
        e = e.cause  # a method's exception (Ray wraps the original one; nested calls wrap it again)
    if isinstance(e, ray.exceptions.RayActorError):
        text = ANSI.sub("", str(e))
        if e.actor_init_failed:  # Ray keeps the constructor's exception only as traceback text
            lines = text.splitlines()
            for i in range(len(lines) - 1, -1, -1):  # the last "Type: message" line, and the message's rest
                m = _LAST_EXCEPTION_LINE.match(lines[i].strip())
                if m:
                    return m[1].rsplit(".", 1)[-1], " ".join(" ".join([m[2], *lines[i + 1:]]).split())
            return type(e).__name__, " ".join(text.split())
        detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes| There are some potential|$)", text, re.S)
        pid = re.search(r"\bpid: (\d+)", text)
        return type(e).__name__, (f"the actor's process{f' (pid {pid[1]})' if pid else ''} is gone"
                                  + (f": {' '.join(detail[1].split())}" if detail else "")
                                  + " (killed, out of memory, or crashed)")
    message = " ".join(ANSI.sub("", str(e)).split())
    return type(e).__name__, message[:2000]


def failure_paragraph(e: BaseException, run_dir: Path, command: str, where: str = "",
                      trace: Path | None = None) -> str:
    """The one paragraph a failed run leaves in train.log and on the terminal: what failed (which
    actor, which call, which step), the root cause, where the tracebacks are, the last complete
    checkpoint and the command that continues the run (`command` + --resume; last, to copy)."""
    if isinstance(e, ActorError):
        what = (f"{e.actor} {'died' if e.died else 'raised an exception'} in {e.method} at {e.where}{e.note}: "
                f"{e.root_type}: {e.root_message}")
    else:
        what = "the driver failed{}: {}: {}".format(f" at {where}" if where else "", *root_cause(e))
    try:
        last = latest_checkpoint(run_dir)
    except (OSError, ValueError, KeyError):  # an unreadable pointer: --resume says what is wrong with it
        last = None
    if last is not None:
        then = (f"The last complete checkpoint is step {last[0]} ({last[1]}); continue the run with: "
                f"{command} --resume")
    else:
        then = f"No checkpoint was written; start the run again with: {command} --overwrite"
    return f"The run failed: {what.rstrip('.')}{f' (tracebacks: {trace})' if trace else ''}. {then}"
