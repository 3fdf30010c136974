"""NVML source: device and per-process GPU memory by device UUID (the only pynvml importer).

Every NVML call runs on one worker thread owned by the source; `read()` asks it for a fresh
reading and waits for it at most `wait_s`, then returns the latest *completed* one: a hung or
slow NVML call must not stop polling, event intake and reloads. A reading whose numbers are
older than `deadline_s` is reported down ("late") and never reaches the forecast, and the loop
goes on at its own pace.

Failures are classified rather than ending the session on any error: a per-device error marks
that device down for this reading; a lost GPU stays down until the next re-enumeration; only
"the library or driver is gone" errors end the session. Re-initialising backs off exponentially
(0.5 s -> 30 s by default).

A reading is a read and a parse: the read (`_Session._ask_devices`) only makes the NVML calls,
recording each call's answer or exception per device (`DeviceAnswers`); `parse_answers`, pure (no
NVML, no clock, no I/O), decides from those records what the reading says: the devices read, those
down and why, each pid's bytes, the errors, and whether the session ends (table-tested on
recorded answers: tests/unit/test_nvml_parse.py). Init, teardown, backoff and the reuse of equal
samples stay in the session.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

from torch_watchdog.sidecar.core.observations import DeviceSample

# The age past which a reading's numbers are not used: about 2 polls at the default 0.1 s
# interval (config.poll_interval_s); the daemon passes min(1.0, 2 * poll_interval_s).
DEADLINE_S = 0.2
# How long `read()` waits for the reading it asked for when the worker was idle: a healthy read
# completes in 1-100 ms (p99 on a busy H200 host: docs/architecture.md), so most polls get fresh
# numbers; a slow or hung NVML costs one poll at most this much, and later polls nothing (the
# worker is busy).
WAIT_S = 0.05
# Re-init backoff: the first failure after a good reading retries at once (a driver reload
# recovers at the next poll, as before); then BACKOFF_MIN_S, doubling, capped at BACKOFF_MAX_S.
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0
CLOSE_WAIT_S = 1.0  # close() waits this long for a busy worker; a hung one is left behind

# Errors meaning "this binding's call does not exist in the installed driver" (old drivers lack
# the _v2 symbols; nvidia-ml-py's unversioned process call turns FunctionNotFound into
# NVMLLibraryMismatchError, which is NOT an NVMLError subclass).
_VERSION_ERRORS = ("NVMLError_FunctionNotFound", "NVMLError_ArgumentVersionMismatch",
                   "NVMLLibraryMismatchError")
# The process list is refused or unsupported (MIG without privileges, containers without the
# host's pid namespace, vGPU): the sidecar then meters the device as a whole.
_DENIED_ERRORS = ("NVMLError_NoPermission", "NVMLError_NotSupported")
# The library or driver is gone (unloaded, reloaded, upgraded under us): the session is dead.
_GONE_ERRORS = ("NVMLError_Uninitialized", "NVMLError_DriverNotLoaded",
                "NVMLError_LibraryNotFound", "NVMLError_LibRmVersionMismatch")
# One GPU fell off the bus: its handle is dead until a re-enumeration.
_LOST_ERRORS = ("NVMLError_GpuIsLost",)
GONE, LOST, OTHER = "gone", "lost", "other"


@dataclass(frozen=True)
class NvmlReading:
    # only devices read successfully in this reading; every other known device is in `down`
    devices: tuple[DeviceSample, ...] = ()
    # pid -> {device uuid: usedGpuMemory bytes, None = NVML does not say}; every requested pid the
    # reading was taken for has an entry (a pid first asked for after it has none: unknown), and
    # a device appears in it only if NVML listed the pid on that device
    process_gpu_bytes: dict[int, dict[str, Optional[int]]] = field(default_factory=dict)
    up: bool = True  # at least one device read, within the deadline
    error: Optional[str] = None
    # wall time of the reading's NVML calls, init and enumeration excluded (p99 20-100 ms on a
    # busy host: docs/architecture.md)
    query_s: float = 0.0
    down: dict[str, str] = field(default_factory=dict)  # device uuid -> why it is not in devices
    age_s: float = 0.0  # how long ago (source clock) the reading's NVML calls completed
    t: Optional[float] = None  # when they completed (source clock: monotonic); None: no answer


@dataclass(frozen=True)
class _Result:
    """What the worker publishes: one completed attempt at a reading."""
    t: float
    query_s: float
    devices: tuple[DeviceSample, ...] = ()
    per_pid: dict[int, dict[str, Optional[int]]] = field(default_factory=dict)
    down: dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None
    retry_at: Optional[float] = None  # the session is down; nothing to try before this


# One process-list entry as NVML gave it: (pid, usedGpuMemory; None where NVML does not say)
ProcessEntry = tuple[int, Optional[int]]


class DeviceAnswers(NamedTuple):
    """One device's NVML answers in one reading, each call's value or the exception it raised:
    what the read records and `parse_answers` decides on."""
    uuid: str
    # (used, total, free) bytes, or what the memory call raised; None: not called (the device
    # was lost earlier this session)
    memory: Union[tuple[int, int, int], Exception, None] = None
    # the process list, or what the call raised; None: not called (no pid asked for, the
    # memory call failed) or no process call in this driver
    processes: Union[list[ProcessEntry], Exception, None] = None


class ParsedAnswers(NamedTuple):
    """What one reading's answers say (`parse_answers`)."""
    devices: tuple[str, ...]  # the uuids read, in enumeration order
    per_pid: dict[int, dict[str, Optional[int]]]  # as _Result.per_pid
    down: dict[str, str]      # uuid -> why it is not in devices
    lost: dict[str, str]      # found lost in this reading: not called until re-enumeration
    reasons: tuple[str, ...]  # each failed call's bounded label (`errors`), in call order
    error: Optional[str]
    # the session ends with this error (the library or driver is gone, or nothing is left to
    # read); devices and per_pid are then empty, and down holds the reasons the session keeps
    end: Optional[str] = None


class NvmlSource:
    """Reads NVML on a worker thread; every failure becomes an `up=False` reading or a device in
    `down`, never an exception, and `read()` never blocks for longer than `wait_s`."""

    def __init__(self, backend: Any = None, clock: Callable[[], float] = time.monotonic, *,
                 deadline_s: float = DEADLINE_S, wait_s: float = WAIT_S,
                 backoff_min_s: float = BACKOFF_MIN_S, backoff_max_s: float = BACKOFF_MAX_S):
        self._clock = clock
        # public: the daemon may change both when a reload changes poll_interval_s
        self.deadline_s = deadline_s
        self.wait_s = wait_s
        self._shared = _Shared(_Session(backend, clock, backoff_min_s, backoff_max_s))
        self._late = False
        self._late_count = 0
        # (per_pid, pids, presented): the last copy
        self._shown: tuple[Any, ...] = (None, None, None)
        # a source dropped without close() stops its worker (tests, a replaced daemon source)
        weakref.finalize(self, self._shared.stop_worker)

    # -- what the daemon reads ------------------------------------------------------------------
    @property
    def errors(self) -> dict[str, int]:
        """Errors by bounded reason: an NVML error class name, "other" (a non-NVML exception),
        "init" (a failed init/enumeration), "late" (one per stall, however many polls)."""
        with self._shared.cond:
            out = dict(self._shared.errors)
        if self._late_count:
            out["late"] = self._late_count
        return out

    @property
    def inits(self) -> int:
        """nvmlInit calls made (successful or not): an init storm shows here."""
        return self._shared.session.inits

    @property
    def shutdowns(self) -> int:
        return self._shared.session.shutdowns

    def read(self, pids: set[int], wait_s: Optional[float] = None) -> NvmlReading:
        """The latest completed reading, presented for `pids`; asks the worker for a fresh one
        and waits for it at most `wait_s` (only when the worker was idle: a busy worker is
        slow or hung, and waiting on it would just slow the poll loop)."""
        want = frozenset(pids)
        wait_s = self.wait_s if wait_s is None else wait_s
        sh = self._shared
        with sh.cond:
            now = self._clock()
            res = sh.latest
            backing_off = (res is not None and res.retry_at is not None and now < res.retry_at
                           and sh.busy_since is None)
            if not backing_off and sh.ensure_worker():  # in backoff the worker stays asleep
                idle = sh.busy_since is None and sh.want is None
                sh.asked += 1
                ticket, sh.want = sh.asked, want
                if sh.first_asked is None:
                    sh.first_asked = now
                sh.cond.notify_all()
                if idle and wait_s > 0:
                    sh.cond.wait_for(lambda: sh.served >= ticket, wait_s)
                now = self._clock()
            reading = self._present(sh.latest, now, want, sh.busy_since, sh.first_asked)
        return reading

    def close(self) -> None:
        """Stops the worker, which shuts NVML down; a later read() starts over."""
        sh = self._shared
        thread = sh.stop_worker()
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_WAIT_S)
        with sh.cond:
            if sh.thread is None or not sh.thread.is_alive():
                sh.latest, sh.first_asked, sh.want = None, None, None
        self._late = False

    # -- presentation (read()'s caller thread) ------------------------------------------------
    def _present(self, res: Optional[_Result], now: float, pids: frozenset[Any],
                 busy_since: Optional[float], first_asked: Optional[float]) -> NvmlReading:
        deadline = self.deadline_s
        stalled = busy_since is not None and now - busy_since > deadline
        if res is None:
            waited = now - (first_asked if first_asked is not None else now)
            if waited > deadline:
                return self._late_reading(None, now, f"no answer for {waited:.2f} s")
            return NvmlReading(up=False, error="NVML not read yet")
        age = now - res.t
        # a session that is down and backing off publishes nothing new: its answer stands;
        # otherwise the worker was asked every poll, and numbers past the deadline are late.
        # A reading's oldest number is as old as its calls took plus its age: a call that hung
        # 20 s and then returned completes a reading whose first numbers are 20 s old.
        if res.retry_at is None or stalled:
            if res.devices and res.query_s > deadline:
                return self._late_reading(res, now, f"its calls took {res.query_s:.2f} s")
            if age + res.query_s > deadline:
                return self._late_reading(res, now, f"no answer for {age + res.query_s:.2f} s")
        self._late = False
        if res.per_pid is not self._shown[0] or pids != self._shown[1]:
            # a copy for the caller, made again only when the numbers or the pids change
            self._shown = (res.per_pid, pids, {pid: dict(per) for pid, per in
                                               res.per_pid.items() if pid in pids})
        return NvmlReading(devices=res.devices,
                           process_gpu_bytes=self._shown[2],
                           up=bool(res.devices), error=res.error, query_s=res.query_s,
                           down=dict(res.down), age_s=age, t=res.t)

    def _late_reading(self, res: Optional[_Result], now: float, why: str) -> NvmlReading:
        if not self._late:  # one count per stall: a 20 s hang is one error, not 200
            self._late, self._late_count = True, self._late_count + 1
        error = f"NVML read late: {why}"
        known = [] if res is None else [d.uuid for d in res.devices] + list(res.down)
        return NvmlReading(up=False, error=error, down={uuid: error for uuid in known},
                           query_s=0.0 if res is None else res.query_s,
                           age_s=0.0 if res is None else now - res.t,
                           t=None if res is None else res.t)


class _Shared:
    """State shared by read() and the worker, under `cond`. Holds no reference to the source,
    so a dropped source can be finalised (and its worker stopped)."""

    def __init__(self, session: "_Session"):
        self.cond = threading.Condition()
        self.session = session
        self.want: Optional[frozenset[Any]] = None   # the pids of the newest unserved request
        self.asked = self.served = 0            # request tickets
        self.first_asked: Optional[float] = None
        self.busy_since: Optional[float] = None  # source clock when the worker took a request
        self.latest: Optional[_Result] = None
        self.errors: dict[str, int] = {}
        self.thread: Optional[threading.Thread] = None
        self.stop: Optional[threading.Event] = None

    def ensure_worker(self) -> bool:
        """Under cond. At most one worker: while a stopped one is still stuck in a call, no
        second one starts (False), and reads report late until it comes back and exits."""
        if self.thread is not None and self.thread.is_alive():
            return self.stop is not None and not self.stop.is_set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_work, args=(self, self.stop), name="nvml-worker",
                                       daemon=True)  # a hung NVML call must not block exit
        self.thread.start()
        return True

    def stop_worker(self) -> Optional[threading.Thread]:
        with self.cond:
            if self.stop is not None:
                self.stop.set()
            self.cond.notify_all()
            return self.thread


def _work(sh: _Shared, stop: threading.Event) -> None:
    """The worker: sleeps on the condition (no polling, no timeout) until asked or stopped."""
    while True:
        with sh.cond:
            while not stop.is_set() and sh.want is None:
                sh.cond.wait()
            if stop.is_set():
                break
            pids, ticket = sh.want, sh.asked
            sh.want, sh.busy_since = None, sh.session.clock()
        try:
            res = sh.session.read(set(pids or ()))
        except Exception as exc:  # a bug here must not kill the worker (reads would go late)
            t = sh.session.clock()
            res = _Result(t=t, query_s=0.0, error=f"NVML read failed: {_describe(exc)}")
        with sh.cond:
            sh.latest, sh.served, sh.busy_since = res, ticket, None
            sh.errors = dict(sh.session.errors)
            sh.cond.notify_all()
    sh.session.close()


class _Session:
    """The NVML session; touched only by the worker thread."""

    def __init__(self, backend: Any, clock: Callable[[], float], backoff_min_s: float,
                 backoff_max_s: float):
        self.nvml = backend  # None: `import pynvml` on the first init attempt
        self.clock = clock
        self.backoff = (backoff_min_s, backoff_max_s)
        self.initialized = False
        self.devices: list[tuple[Any, str]] = []  # (handle, uuid), enumerated once per init
        self.lost: dict[str, str] = {}       # uuid -> why: dead handles, not called again
        self.vanished: dict[str, str] = {}   # known uuids the last enumeration did not list
        self.known: dict[str, None] = {}     # every uuid enumerated since close(), in order
        self.memory_v2 = True
        # the last reading's numbers, handed out again while equal: a still GPU costs no new
        # sample, and the step compares by identity first (benchmarks/host_scale.py)
        self.last_samples: dict[str, DeviceSample] = {}
        self.last_devices: tuple[DeviceSample, ...] = ()
        self.last_per_pid: dict[int, dict[str, Optional[int]]] = {}
        self.proc_calls: Optional[list[Any]] = None  # the process-list calls that may work here
        self.memory_version: Any = None         # the binding's v2 struct version, looked up
        self.retry_at: Optional[float] = None   # session down: the next init attempt
        self.reenum_at: Optional[float] = None  # a GPU was lost: re-init then
        self.error: Optional[str] = None        # why the session is down
        self.why: dict[str, str] = {}           # per device, when it ended with devices down
        self.streak = 0                         # failures since the last clean reading
        self.retry_now = False                  # the next failure retries without waiting
        self.errors: Counter[str] = Counter()
        self.inits = self.shutdowns = 0

    def read(self, pids: set[int]) -> _Result:
        start = self.clock()
        if self.initialized and self.reenum_at is not None and start >= self.reenum_at:
            self._teardown()  # re-enumerate: a lost GPU may be back, or gone for good
        if not self.initialized:
            if self.retry_at is not None and start < self.retry_at:
                return self._down(start)
            if not self._init(start):
                return self._down(start)
            start = self.clock()  # the numbers' age starts here: init is not part of it
        return self._read_devices(start, pids)

    def close(self) -> None:
        self._teardown()
        self.vanished, self.known, self.why, self.retry_at, self.error = {}, {}, {}, None, None

    # -- session ----------------------------------------------------------------------------
    def _init(self, now: float) -> bool:
        try:
            nvml = self._load()
            self.inits += 1
            nvml.nvmlInit()
            self.initialized = True
            devices, failed = self._enumerate(nvml)
        except Exception as exc:  # includes ImportError: no nvidia-ml-py is "NVML unavailable"
            self.errors["init"] += 1
            self._teardown()
            self.why = {}
            self._failed(now, f"NVML unavailable: {_describe(exc)}")
            return False
        listed = {uuid for _, uuid in devices}
        for uuid in self.known:
            if uuid not in listed:
                self.vanished[uuid] = "vanished: not listed after re-enumeration" + (
                    f" ({failed})" if failed else "")
        for uuid in listed:
            self.vanished.pop(uuid, None)
            self.known[uuid] = None
        self.devices, self.lost, self.memory_v2 = devices, {}, True
        self.proc_calls = self.memory_version = None
        self.retry_at = self.reenum_at = self.error = None
        self.why = {}
        return True

    def _enumerate(self, nvml: Any) -> tuple[list[tuple[Any, str]], Optional[str]]:
        devices, failed = [], None
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                devices.append((handle, _text(nvml.nvmlDeviceGetUUID(handle))))
            except Exception as exc:
                if _kind(exc) == GONE:
                    raise
                self.errors[_reason(exc)] += 1  # one GPU: the others are still watched
                failed = f"index {i}: {_describe(exc)}"
        return devices, failed

    def _load(self) -> Any:
        if self.nvml is None:
            import pynvml  # lazy: importing this module must work without nvidia-ml-py
            self.nvml = pynvml
        return self.nvml

    def _teardown(self) -> None:
        if self.initialized:
            self.shutdowns += 1
            try:
                self.nvml.nvmlShutdown()  # pynvml counts inits; unbalanced ones leak the library
            except Exception:
                pass
        self.initialized = False
        self.devices, self.lost, self.reenum_at = [], {}, None

    def _failed(self, now: float, error: str) -> None:
        self.error = error
        self.retry_at = now + self._delay()

    def _delay(self) -> float:
        if self.retry_now:  # the first failure after a clean reading
            self.retry_now = False
            return 0.0
        self.streak += 1
        low, high = self.backoff
        return min(high, low * 2.0 ** min(self.streak - 1, 32))

    def _down(self, start: float) -> _Result:
        t = self.clock()
        down = {uuid: self.vanished.get(uuid) or self.why.get(uuid) or self.error or "NVML down"
                for uuid in self.known}
        return _Result(t=t, query_s=t - start, down=down, error=self.error,
                       retry_at=self.retry_at)

    # -- one reading: the read (NVML calls only), then parse_answers ------------------------
    def _read_devices(self, start: float, pids: set[int]) -> _Result:
        answers = self._ask_devices(pids)
        self._keep_samples(answers)
        parsed = parse_answers(answers, pids, self.lost, self.vanished)
        self.errors.update(parsed.reasons)
        self.lost.update(parsed.lost)
        now = self.clock()
        if parsed.end is not None:  # the library is gone, or nothing is left to read
            self._teardown()
            self.why = parsed.down
            self._failed(now, parsed.end)
            return self._down(start)
        if self.lost:
            if self.reenum_at is None:
                self.reenum_at = now + self._delay()
        elif parsed.devices:
            self.streak, self.retry_now = 0, True
        return _Result(t=now, query_s=now - start, devices=self._samples(parsed.devices),
                       per_pid=self._same_per_pid(parsed.per_pid), down=parsed.down,
                       error=parsed.error)

    def _ask_devices(self, pids: set[int]) -> list[DeviceAnswers]:
        """The read: every device's NVML calls, each one's answer or exception recorded as it
        came. A device lost this session is not called (its handle is dead), and a call that
        finds the library gone ends the read (no other call can work)."""
        answers: list[DeviceAnswers] = []
        lost = self.lost
        for handle, uuid in self.devices:
            answer = DeviceAnswers(uuid) if lost and uuid in lost \
                else self._ask_device(handle, uuid, pids)
            answers.append(answer)
            if _library_gone(answer):
                break
        return answers

    def _ask_device(self, handle: Any, uuid: str, pids: set[int]) -> DeviceAnswers:
        nvml = self.nvml
        try:
            mem = self._memory_info(nvml, handle)
            memory = (int(mem.used), int(mem.total), int(mem.free))
        except Exception as exc:
            return DeviceAnswers(uuid, exc)
        if not pids:  # the process list is the slow call; skip it when nobody asks
            return DeviceAnswers(uuid, memory)
        try:
            return DeviceAnswers(uuid, memory, self._process_list(nvml, handle))
        except Exception as exc:
            return DeviceAnswers(uuid, memory, exc)

    def _process_list(self, nvml: Any, handle: Any) -> Optional[list[ProcessEntry]]:
        """The device's process list as (pid, usedGpuMemory) entries; None where the driver
        has no process call (a refused list raises). The unversioned call uses _v3, and
        drivers older than the bindings only have _v2: the calls are looked up once a session,
        and one the driver lacks is dropped after its first failure (as the v2 memory call
        is)."""
        calls = self.proc_calls
        if calls is None:
            calls = self.proc_calls = [c for c in (
                getattr(nvml, "nvmlDeviceGetComputeRunningProcesses", None),
                getattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v2", None)) if c]
        while calls:
            try:
                infos = calls[0](handle)
                break
            except _errors(nvml, _VERSION_ERRORS):
                del calls[0]
        else:
            return None  # no usable process call: device-level only
        return [(int(info.pid), info.usedGpuMemory) for info in infos]

    def _keep_samples(self, answers: list[DeviceAnswers]) -> None:
        """A sample for every device whose memory call answered, the last one kept while its
        numbers are equal: a still GPU costs no new sample, and the step compares by identity
        first (benchmarks/host_scale.py)."""
        last = self.last_samples
        for answer in answers:
            memory = answer.memory
            if isinstance(memory, tuple):
                used, total, free = memory
                sample = last.get(answer.uuid)
                if sample is None or sample.used_bytes != used or sample.free_bytes != free \
                        or sample.total_bytes != total:
                    last[answer.uuid] = DeviceSample(answer.uuid, used, total, free)

    def _samples(self, uuids: tuple[str, ...]) -> tuple[DeviceSample, ...]:
        """The devices read, as the last reading's tuple while it holds the same samples."""
        samples = [self.last_samples[uuid] for uuid in uuids]
        devices = self.last_devices
        if len(devices) != len(samples) or \
                any(a is not b for a, b in zip(samples, devices, strict=True)):
            devices = self.last_devices = tuple(samples)
        return devices

    def _same_per_pid(self, per_pid: dict[int, dict[str, Optional[int]]]
                      ) -> dict[int, dict[str, Optional[int]]]:
        if per_pid == self.last_per_pid:
            return self.last_per_pid  # the same object: read() presents it as it did
        self.last_per_pid = per_pid
        return per_pid

    def _memory_info(self, nvml: Any, handle: Any) -> Any:
        version = self.memory_version
        if version is None:  # looked up once a session
            version = self.memory_version = getattr(nvml, "nvmlMemory_v2", None)
        if self.memory_v2 and version is not None:
            try:
                # v2 `used` excludes driver-reserved memory and matches nvidia-smi; v1 counts
                # the reserved part as used (hundreds of MB on a data-centre GPU)
                return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except _errors(nvml, _VERSION_ERRORS):
                self.memory_v2 = False  # old driver: don't pay for the failing call every poll
        return nvml.nvmlDeviceGetMemoryInfo(handle)


# -- the parse: a reading from its recorded answers (pure: no NVML, no clock, no I/O) ---------
def parse_answers(answers: Sequence[DeviceAnswers], pids: AbstractSet[int],
                  lost: Mapping[str, str], vanished: Mapping[str, str]) -> ParsedAnswers:
    """What one reading's answers say, for `pids`: which devices were read, which are down and
    why, each pid's bytes per device, the failed calls to count, and whether the session ends.
    `lost`: devices lost earlier this session (not called); `vanished`: known devices the last
    enumeration did not list."""
    devices: list[str] = []
    per_pid: dict[int, dict[str, Optional[int]]] = {pid: {} for pid in pids}
    down: dict[str, str] = {}
    found_lost: dict[str, str] = {}
    reasons: list[str] = []
    for uuid, memory, processes in answers:
        if uuid in lost or memory is None:  # not called: its handle is dead
            down[uuid] = lost.get(uuid, "not read")
            continue
        failure = _failed_call(memory, processes)
        if failure is not None:
            reasons.append(_reason(failure))
            why, kind = _describe(failure), _kind(failure)
            if kind == GONE:  # the session is over: no device has a reason of its own
                error = f"NVML read failed: {why}"
                return ParsedAnswers((), {}, {}, found_lost, tuple(reasons), error, end=error)
            if kind == LOST:  # dead until a re-enumeration; its numbers just read are not
                found_lost[uuid] = down[uuid] = why  # trusted either
                continue
            if failure is memory:  # this reading only: the next one calls it again
                down[uuid] = why
                continue
            # the process list failed: the device's numbers stand, per-process stays unknown
        devices.append(uuid)
        if isinstance(processes, list) and isinstance(memory, tuple):
            for pid, used in _process_bytes(processes, pids, memory[1]).items():
                per_pid[pid][uuid] = used
    for uuid, why in vanished.items():
        down.setdefault(uuid, why)
    if not devices and (lost or found_lost or not answers):
        # nothing left to read on this session: it ends (and is retried, with backoff)
        error = _summary(down) if down else "NVML read failed: no GPU listed"
        return ParsedAnswers((), {}, down, found_lost, tuple(reasons), error, end=error)
    return ParsedAnswers(tuple(devices), per_pid, down, found_lost, tuple(reasons),
                         _down_error(down, bool(devices)))


def _failed_call(memory: Union[tuple[int, int, int], Exception],
                 processes: Union[list[ProcessEntry], Exception, None]) -> Optional[Exception]:
    """The device's failed call, to count: the memory call's, else the process list's unless
    it was refused or is unsupported (the device is then metered as a whole)."""
    if isinstance(memory, Exception):
        return memory
    if isinstance(processes, Exception) and not _is(processes, _DENIED_ERRORS):
        return processes
    return None


def _process_bytes(entries: list[ProcessEntry], pids: AbstractSet[int], total: int
                   ) -> dict[int, Optional[int]]:
    """The asked-for pids of a process list: usedGpuMemory, None where NVML does not say."""
    found: dict[int, Optional[int]] = {}
    for pid, used in entries:
        if pid not in pids:
            continue
        # a binding whose struct layout does not match the driver's reads pids or garbage
        # as memory: a value beyond the GPU's size is not a reading
        if used is not None and not 0 <= used <= total:
            used = None
        if pid in found:  # one entry per MIG/compute instance: sum, unknown if any is
            prev = found[pid]
            used = None if used is None or prev is None else prev + used
        found[pid] = used
    return found


def _down_error(down: dict[str, str], any_read: bool) -> Optional[str]:
    if not down:
        return None
    if not any_read:
        return _summary(down)
    return f"{len(down)} GPU(s) down: " + _summary(down, prefix="")


def _library_gone(answer: DeviceAnswers) -> bool:
    """A call found the library or driver gone: the read stops there (no other call works)."""
    _, memory, processes = answer
    failed = memory if isinstance(memory, Exception) else processes
    return isinstance(failed, Exception) and _kind(failed) == GONE


def _summary(down: dict[str, str], prefix: str = "NVML read failed: ") -> str:
    reasons = list(dict.fromkeys(down.values()))
    if len(reasons) == 1:
        return prefix + reasons[0]
    return prefix + "; ".join(f"{uuid}: {why}" for uuid, why in down.items())


def _errors(nvml: Any, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    # backends (fakes, older bindings) may lack some classes; `except ()` then catches nothing
    return tuple(cls for cls in (getattr(nvml, name, None) for name in names)
                 if isinstance(cls, type) and issubclass(cls, BaseException))


def _is(exc: BaseException, names: tuple[str, ...]) -> bool:
    # by class name along the MRO: works for pynvml's generated classes and for fakes alike
    return any(cls.__name__ in names for cls in type(exc).__mro__)


def _kind(exc: BaseException) -> str:
    return GONE if _is(exc, _GONE_ERRORS) else LOST if _is(exc, _LOST_ERRORS) else OTHER


def _reason(exc: BaseException) -> str:
    """A bounded metric label: pynvml's error class names are a fixed set (~30); anything else
    (a binding bug's TypeError, ...) is "other"."""
    name = type(exc).__name__
    return name if name.startswith("NVML") and name.isidentifier() and len(name) <= 64 \
        else "other"


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _describe(exc: BaseException) -> str:
    try:
        message = str(exc)  # pynvml's __str__ may itself call into the (missing) library
    except Exception:
        message = ""
    name = type(exc).__name__
    return f"{name}: {message[:200]}" if message else name
