"""The worker processes `llmem serve`'s computations run in, so that no request holds the server: a bounded lane of
processes per kind of work (estimates and sweeps in one, plans in another: a slow plan never delays an estimate),
each request given a time limit after which its worker is killed and replaced (a computation in Python cannot be
interrupted in its own thread), and killed too when its client leaves. Workers fork from multiprocessing's fork
server, which imported torch and transformers and ran a small estimate once (serve_warm.py): a replacement is warm
within a second. Answers are kept in a small LRU keyed on the request, so that a repeated one costs nothing."""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from llmem.cli.serve_query import LocalPaths
from llmem.cli.serve_work import Answer, Work, perform

POLL_S = 0.1                # how often a waiting request looks whether its client left or its time ran out


class Refused(Exception):
    """The work was not answered: out of time, the server busy, the client gone, or the worker lost."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class Place:
    """Where a request's files go: `uploads` holds one folder per request in flight (removed with its answer);
    `empty` is the workers' working folder, so that no relative name answers to a file on the server."""
    uploads: Path
    empty: Path
    paths: LocalPaths


def _worker_main(conn: Connection, place: Place) -> None:
    """A worker: answers the jobs sent on `conn` until it closes (or the parent process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C is the server's to handle: it kills the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.chdir(place.empty)
    except OSError:                                     # the server stopped while this worker started
        return
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    conn.send("ready")
    while True:
        try:
            work, folder = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(perform(work, folder, place.paths))


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


class Worker:
    def __init__(self, context, place: Place):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, place), daemon=True, name="llmem-serve")
        self.process.start()
        child.close()
        self._kill_lock = threading.Lock()
        self._killed = False

    def kill(self) -> None:
        """Once, whoever asks first: a stop (the signal handler's close()) and the request thread that sees its
        worker die both kill it. Connection.close() is not thread-safe: two closes at once closed its descriptor
        twice (EBADF in the signal handler, or worse, a descriptor opened meanwhile by another thread)."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class Lane:
    """`size` worker processes for one kind of work; a request waits for a free one, within its time limit."""

    def __init__(self, name: str, size: int, place: Place):
        self.name, self.size, self.place = name, size, place
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["llmem.cli.serve_warm"])
        self.idle: queue.Queue[Worker] = queue.Queue()
        self.live: set[Worker] = set()          # every worker started, idle or busy (close() kills them all)
        self.closed = False
        for _ in range(size):
            self._start()

    def _start(self) -> None:
        """A new worker, handed out once it says it is ready (in a thread: a request never waits on a fork)."""
        def start() -> None:
            if self.closed:
                return
            try:
                w = Worker(self.context, self.place)
                self.live.add(w)
                if w.conn.poll(300) and w.conn.recv() == "ready" and not self.closed:
                    self.idle.put(w)
                    return
                self._kill(w)
            except (OSError, EOFError, ValueError):     # the server is stopping
                pass
        threading.Thread(target=start, daemon=True, name=f"llmem-serve-start-{self.name}").start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Every worker started and idle (tests and benchmarks wait for it; the server need not)."""
        deadline = time.monotonic() + timeout_s
        while self.idle.qsize() < self.size and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.idle.qsize() >= self.size

    def run(self, work: Work, limit_s: float, cancelled: threading.Event) -> Answer:
        """The work's answer from a worker; Refused when out of time (waiting included), when `cancelled` is set
        (its client left) or when the worker is lost. A worker not answered in time is killed and replaced."""
        deadline = time.monotonic() + limit_s
        w = self._acquire(deadline, cancelled)
        folder = Path(tempfile.mkdtemp(prefix="req-", dir=self.place.uploads))
        done = False
        try:
            w.conn.send((work, folder))
            while not w.conn.poll(POLL_S):
                if cancelled.is_set():
                    raise Refused(499, "cancelled")
                if time.monotonic() >= deadline:
                    raise Refused(504, "timeout")
            answer = w.conn.recv()
            done = True
            return answer
        except (EOFError, OSError, BrokenPipeError):
            raise Refused(503, "lost") from None
        finally:
            if done:
                self.idle.put(w)
            else:
                self._kill(w)
                if not self.closed:
                    self._start()
            shutil.rmtree(folder, ignore_errors=True)

    def _acquire(self, deadline: float, cancelled: threading.Event) -> Worker:
        """An idle worker, waited for until `deadline` (or the request is cancelled, or the lane closed)."""
        while not (self.closed or cancelled.is_set()):
            try:
                return self.idle.get(timeout=POLL_S)
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise Refused(503, "busy") from None
        raise Refused(499 if cancelled.is_set() else 503, "stopped")

    def _kill(self, w: Worker) -> None:
        self.live.discard(w)
        w.kill()

    def close(self) -> None:
        """Every worker killed, busy ones too: the requests waiting on them are answered at once."""
        self.closed = True
        for w in list(self.live):
            self._kill(w)


class InlineLane:
    """The work in this process, one request at a time, without time limits: for tests that patch the library."""

    def __init__(self, place: Place):
        self.place = place
        self.lock = threading.Lock()

    def run(self, work: Work, limit_s: float, cancelled: threading.Event) -> Answer:
        folder = Path(tempfile.mkdtemp(prefix="req-", dir=self.place.uploads))
        try:
            with self.lock:
                return perform(work, folder, self.place.paths)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def wait_ready(self, timeout_s: float) -> bool:
        return True

    def close(self) -> None:
        pass


class Cache:
    """The last `size` answers (200s and refusals: the same request gives the same answer), keyed on Work.key()."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict[str, Answer] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: str) -> Answer | None:
        with self.lock:
            answer = self.entries.get(key)
            if answer is not None:
                self.entries.move_to_end(key)
            return answer

    def put(self, key: str, answer: Answer) -> None:
        if answer.status not in (200, 400) or self.size <= 0:
            return
        with self.lock:
            self.entries[key] = answer
            self.entries.move_to_end(key)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
