"""The engine's half of a streamed weight sync: one update object with explicit states.

    u = EngineUpdate()
    u.planned(EnginePlan(...))       # idle | done | broken | planned -> planned
    u.started()                      # planned -> streaming
    u.receive([(name, shape, dtype)]) # streaming: each chunk checked against the plan
    u.complete()                     # streaming -> done (every planned tensor arrived)
    u.fail(why)                      # streaming -> broken (a chunk failed after others may be in place)
    u.aborted(why)                   # streaming -> broken, or back where it was if no chunk arrived

RolloutWorker (rollout/worker.py) holds one and makes vLLM's calls; this object holds every fact
about the update (its plan, what arrived, whether vLLM's update session is open, the engine's
seconds per phase, why the weights are broken, the transport's handshakes) and decides every
transition. It imports nothing heavy and calls nothing: tests/rollout/test_rollout_sync_engine.py
walks every transition without an engine.

States and what an engine does in each:

| state     | meaning                                                 | sample? |
|-----------|---------------------------------------------------------|---------|
| idle      | no streamed update yet                                  | yes     |
| planned   | a checked plan is held, nothing started                 | yes (unless `broken` is set) |
| streaming | started: chunks arrive; some may be in place already    | no      |
| done      | the last update completed: every weight is the trainer's| yes     |
| broken    | an update failed after it had started (or the weights were discarded): a mix of old and new | no |

`broken` (the reason) outlives a new plan: an engine that is broken and planned still refuses to
sample, until an update completes. A plan from `streaming` is refused (finish or abort first), and
so is every step out of order (IllegalTransition, a RuntimeError, names the step, the state and
what to call first). `aborted` is legal in every state: the trainer sends it without knowing how
far an engine got (a no-op outside `streaming`, and in `planned` the plan stays).

What is checked where, and why there (the sync's invariants; rollout/sync.py holds the trainer's):
- E1 plan, engine process (RolloutWorker.plan_weight_update -> rollout.weights.plan_metadata, and
  for kernel format rollout.kernel_format.kernel_layout against the engine's own parameters): every
  name, shape and dtype of the whole update, from metadata alone, before any byte moves. Here,
  because only the engine knows its checkpoint and its parameters.
- E2 chunk, on arrival (`receive`): each tensor in the plan, exactly once, with the planned shape
  and dtype; a chunk is all kernel format or all checkpoint format, and kernel-format chunks come
  before the first checkpoint-format one (vLLM's update session takes the MoE layers' parameters off
  the device until it finishes). Here, because the trainer's stream is another process's code: the
  plan the trainer decided from is not proof of what arrives.
- E3 completion (`complete`): every planned tensor arrived; else the update ends broken. An update
  that is not complete is never reported done.
- E4 a published version (RolloutWorker.take_weights, ipc): every chunk's metadata at once, before
  the update starts (`check_publication`: E2 and E3 walked over the whole publication on a scratch
  update, and each tensor's bytes against its shape and dtype), and the engine's own plan against
  the format and layout the trainer packed in. The whole update is known before a byte moves, so a
  take refuses a bad publication with the weights untouched; only a failure while applying (a CUDA
  error, the process dying) leaves the engine broken (T6).
- F1 a files update (RolloutWorker.update_weights, not streamed): names, shapes, dtypes and NaN/Inf
  of the whole update in the RolloutWorker's process (rollout.weights.plan_update), then names and
  shapes again in vLLM's worker process before anything is applied (rollout/extension.py's
  commit), which reads files another process wrote (the values are not read twice: a second full
  pass over the model's bytes). A failure while applying leaves the engine broken.
"""

from __future__ import annotations

import dataclasses
import enum


class State(enum.Enum):
    IDLE = "idle"
    PLANNED = "planned"
    STREAMING = "streaming"
    DONE = "done"
    BROKEN = "broken"


AT_REST = (State.IDLE, State.DONE, State.BROKEN)


class IllegalTransition(RuntimeError):
    """A step of the update protocol out of order (the engine's state is unchanged)."""


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """An engine's checked plan of one update (RolloutWorker.plan_weight_update makes it).

    format: records.weights.FORMATS; tensors: {update name: (shape, dtype name)}, what the chunks must
    bring; kernel_names: {update name: engine parameter} of the tensors copied in place (kernel
    format); layout: for format "kernel", [engine parameter, shape, dtype name, its trainer
    tensors]; why: {more direct format: why it was not taken}."""

    format: str
    tensors: dict
    kernel_names: dict
    layout: list | None
    why: dict

    @property
    def nbytes(self) -> int:
        import math

        import torch

        return sum(math.prod(shape) * getattr(torch, dt).itemsize for shape, dt in self.tensors.values())


def broken_message(why: str) -> str:
    return (f"a streamed weight update failed after it had started ({why}); the model may hold a mix of old and "
            "new weights until an update completes")


class EngineUpdate:
    """One engine's streamed-update state (see the module docstring for the states and checks)."""

    def __init__(self):
        self.state = State.IDLE
        self.plan: EnginePlan | None = None
        self.received: set[str] = set()
        self.session_open = False  # vLLM's update session (checkpoint-format chunks) has started
        self.seconds: dict[str, float] = {}  # this update's engine calls, by phase
        self.broken: str | None = None  # why the weights are not one complete update; None: they are
        self._rest = State.IDLE  # idle until an update completes, then done (unless broken)
        self._cached: tuple | None = None  # (the update's description, its plan): a run repeats it
        # The transport's handshakes with the trainer (they outlive an update):
        self.transfer_group: str | None = None  # the trainer's NCCL group joined (address:port)
        self.ipc_initialized = False  # vLLM's IPC init handshake made

    def __repr__(self) -> str:
        return f"EngineUpdate({self.state.value}, broken={self.broken!r})"

    def _require(self, step: str, states: tuple, hint: str) -> None:
        if self.state not in states:
            raise IllegalTransition(f"{step}: {hint} (the engine's update is {self.state.value})")

    # -- the plan ------------------------------------------------------------------------------

    def cached_plan(self, key) -> EnginePlan | None:
        """The plan made for the same description `key` before (it depends on nothing else: the
        checkpoint and the engine's parameters are fixed), or None."""
        return self._cached[1] if self._cached is not None and self._cached[0] == key else None

    @property
    def last_plan(self) -> EnginePlan | None:
        """The plan most recently accepted (it stays after its update ended)."""
        return self._cached[1] if self._cached is not None else None

    def require_plannable(self) -> None:
        self._require("plan_weight_update", AT_REST + (State.PLANNED,), "an update is being received; finish it first")

    def planned(self, plan: EnginePlan, key=None) -> None:
        """Hold `plan` (a checked one): from rest, or replacing a plan not started."""
        self.require_plannable()
        self.plan, self.state = plan, State.PLANNED
        if key is not None:
            self._cached = (key, plan)

    def started(self) -> None:
        self._require("start_weight_update", (State.PLANNED,), "no planned update (call plan_weight_update first)")
        self.state, self.received, self.session_open, self.seconds = State.STREAMING, set(), False, {}

    # -- the chunks ----------------------------------------------------------------------------

    def require_streaming(self, step: str) -> None:
        self._require(step, (State.STREAMING,), "no update started (start_weight_update)")

    def receive(self, tensors: list[tuple[str, list, str]]) -> bool:
        """Check one chunk's (name, shape, dtype name) against the plan (E2) and count them in;
        True when the chunk is kernel format (copied in place), False for checkpoint format.
        ValueError names the first tensor out of the plan (the caller then fails the update)."""
        self.require_streaming("update_weight_chunk")
        kinds = set()
        for name, shape, dtype in tensors:
            want = self.plan.tensors.get(name)
            if want is None:
                raise ValueError(f"tensor {name!r} is not in the planned update")
            if name in self.received:
                raise ValueError(f"tensor {name!r} arrived twice")
            if (tuple(shape), dtype) != want:
                raise ValueError(f"tensor {name!r}: planned {list(want[0])} {want[1]}, got {shape} {dtype}")
            self.received.add(name)
            kinds.add(name in self.plan.kernel_names)
        if len(kinds) > 1:
            raise ValueError("a chunk mixes kernel-format and checkpoint-format tensors; the trainer "
                             "streams them separately (rollout/sync.py)")
        if kinds == {True} and self.session_open:
            raise ValueError("kernel-format tensors arrived after checkpoint-format tensors; they "
                             "must come first (rollout/sync.py)")
        return kinds == {True}

    def session_opened(self) -> None:
        self.require_streaming("update_weight_chunk")
        if self.session_open:
            raise IllegalTransition("update_weight_chunk: vLLM's update session is open already (the engine's update "
                                    f"is {self.state.value})")
        self.session_open = True

    def add_seconds(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @property
    def all_received(self) -> bool:
        return self.state is State.STREAMING and len(self.received) == len(self.plan.tensors)

    def missing(self) -> list[str]:
        self.require_streaming("finish_weight_update")
        return sorted(set(self.plan.tensors) - self.received)

    # -- the end -------------------------------------------------------------------------------

    def complete(self) -> dict:
        """streaming -> done once every planned tensor arrived (E3); the engine's report."""
        self.require_streaming("finish_weight_update")
        if not self.all_received:
            raise IllegalTransition(f"finish_weight_update: {len(self.missing())} planned tensor(s) have not "
                                    "arrived; fail the update instead")
        n = len(self.received)
        self.state, self.plan, self.received, self.session_open, self.broken = State.DONE, None, set(), False, None
        self._rest = State.DONE
        return {"tensors": n, "seconds": dict(self.seconds)}

    def fail(self, why: str) -> bool:
        """streaming -> broken; True when vLLM's update session was open (the caller ends it)."""
        self.require_streaming("fail")
        was_open = self.session_open
        self.broken = broken_message(why)
        self.state, self.plan, self.received, self.session_open = State.BROKEN, None, set(), False
        return was_open

    def aborted(self, why: str) -> bool:
        """The trainer will not complete the update. Streaming: back to where it was before the plan
        when no chunk arrived, else broken; elsewhere nothing changes. True when vLLM's update
        session was open (the caller ends it)."""
        if self.state is not State.STREAMING:
            return False
        if self.received:
            return self.fail(f"aborted by the trainer: {why}")
        self.state, self.plan, self.session_open = self._at_rest(), None, False
        return False

    def _at_rest(self) -> State:
        return State.BROKEN if self.broken else self._rest

    # -- updates outside the streamed protocol -------------------------------------------------

    def require_not_streaming(self, step: str) -> None:
        self._require(step, AT_REST + (State.PLANNED,), "a streamed update is being received")

    def applied_whole(self) -> None:
        """A whole update through files (RolloutWorker.update_weights) landed: the weights are the
        trainer's again; a plan not started stays."""
        self.require_not_streaming("update_weights")
        self.broken, self._rest = None, State.DONE
        if self.state in AT_REST:
            self.state = State.DONE

    def discarded(self, why: str) -> None:
        """The weights were lost or half-written outside a streamed update (a files update failing
        while applied, sleep level 2): refuse to sample until an update completes."""
        self.broken = why
        if self.state in AT_REST:
            self.state = State.BROKEN

    def refusal(self, what: str) -> str | None:
        """Why the engine must not `what` (sample, score) now, or None."""
        if self.broken:
            return f"refusing to {what}: {self.broken}"
        if self.state is State.STREAMING:  # some of the update's tensors may be in place, the rest not yet
            return (f"refusing to {what}: a streamed weight update is in progress (it ends when its last planned "
                    "tensor arrives, or with finish_weight_update / abort_weight_update)")
        return None


def check_publication(plan: EnginePlan, chunks: list[tuple[list, list]]) -> None:
    """E4: the chunks of a published version ((name, shape, dtype name) per tensor, their sizes in
    bytes) walked through a scratch update of `plan` (E2 per chunk, then E3) before the engine's
    own update starts; ValueError names the first fault."""
    import math

    import torch

    u = EngineUpdate()
    u.planned(plan)
    u.started()
    for tensors, sizes in chunks:
        if len(sizes) != len(tensors):
            raise ValueError(f"publication: a chunk lists {len(tensors)} tensors and {len(sizes)} sizes")
        for (name, shape, dtype), size in zip(tensors, sizes):
            want = math.prod(shape) * getattr(torch, dtype).itemsize
            if size != want:
                raise ValueError(f"publication: tensor {name!r} {list(shape)} {dtype} is {want} bytes, its chunk says "
                                 f"{size}")
        if not u.receive(tensors) and not u.session_open:
            u.session_opened()
    missing = u.missing()
    if missing:
        raise ValueError(f"publication: {len(missing)} planned tensor(s) are in no chunk, e.g. {missing[0]!r}")
