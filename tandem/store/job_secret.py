"""The job secret, and a store whose keys and values only the job's members
can make (Note [signed store]): :func:`job_secret`, :func:`new_secret`,
:class:`SignedStore`, :func:`signed`.

# Note [signed store]
torch's stores are unauthenticated: whoever reaches a store's port can read
and write any key. An elastic job decides who its members are from keys in
the job's store (a replacement asks to join by writing a key and beating
under another; the generations' member lists, the step decisions, the exit
notices), so a stranger who wrote those keys could join the job, receive its
state, or evict its members. With a job secret (``tandem run`` makes one per
job and hands it to its workers in ``TANDEM_JOB_SECRET``, never on a command
line), the membership's keys go through a :class:`SignedStore`:

* every key's name is an HMAC of its logical name (``tandem/s/<32 hex>``), so
  a stranger cannot name a key the members will read (nor find the counter
  that numbers replacements);
* every value carries an HMAC-SHA256 of its key and contents; a value whose
  MAC does not match (written by anyone without the secret, or moved from
  another key) is refused: :class:`ForgedValueError`, and a log line naming
  the key and the store's address;
* counters (``add``) cannot carry a MAC; their names are secret, and the
  values they number are signed.

What signing does not protect: whoever reaches the store can still list its
keys, overwrite torch's own (unsigned) keys, and replay a value it saw under
the same key; so a job of several nodes also keeps its stores behind TLS keyed
by the same secret (Note [stores behind TLS] in tandem/launch/tunnel.py), and
signing is the guard within that, and the only one under ``--open-stores``. A
member with the secret is trusted, and the tensors of collectives are not
authenticated.
Without a secret (a job started by torchrun, or by hand without
``TANDEM_JOB_SECRET``) the store is used as it is.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["MANY_NODES_NEED_A_SECRET", "SECRET_ENV", "SECRET_FILE_ENV", "ForgedValueError", "SignedStore",
           "job_secret", "new_secret", "secret_for_workers", "secret_mark", "signed", "signed_like"]

logger = logging.getLogger(__name__)

SECRET_ENV = "TANDEM_JOB_SECRET"
"""The job secret itself, as text (``tandem run`` sets it for its workers)."""
SECRET_FILE_ENV = "TANDEM_JOB_SECRET_FILE"
"""A file holding the job secret (for launches where every node reads one file)."""

_MAC_BYTES = 32
_SEP = b"|"


def secret_mark(secret: bytes | None) -> str:
    """The number a process shows for ``secret``: an HMAC of a fixed text, which
    tells nothing of the secret; ``none`` without one (Note [another secret at
    the rendezvous] in tandem/launch/secret_check.py, Note [a stranger asks to
    join] in tandem/control/join_requests.py)."""
    if secret is None:
        return "none"
    return hmac.new(secret, b"tandem: the mark of a job secret", hashlib.sha256).hexdigest()[:16]


class ForgedValueError(RuntimeError):
    """A store value without the job secret's MAC (Note [signed store])."""


def new_secret() -> str:
    """A fresh job secret: 256 random bits, as hex."""
    return secrets.token_hex(32)


def job_secret(environ: dict[str, str] | os._Environ[str] | None = None) -> bytes | None:
    """This job's secret, from ``TANDEM_JOB_SECRET`` or the file ``TANDEM_JOB_SECRET_FILE``
    names; None when neither is set.

    Raises:
        ValueError: the variable or the file is empty, or the file cannot be read.
    """
    env = os.environ if environ is None else environ
    text = env.get(SECRET_ENV)
    if text is None and env.get(SECRET_FILE_ENV):
        path = Path(env[SECRET_FILE_ENV])
        try:
            text = path.read_text().strip()
        except OSError as e:
            raise ValueError(f"{SECRET_FILE_ENV}={path}: the job secret cannot be read ({e.strerror})") from None
    if text is None:
        return None
    if not text.strip():
        raise ValueError(f"the job secret ({SECRET_ENV} or {SECRET_FILE_ENV}) is empty; make one with "
                         "python -c 'import secrets; print(secrets.token_hex(32))'")
    return text.strip().encode()


class SignedStore(dist.Store):
    """``store`` with its keys named and its values signed with ``secret`` (Note
    [signed store]). Takes the calls tandem's membership makes: ``set``,
    ``get``, ``multi_get``, ``check``, ``add``, ``compare_set``, ``wait``, ``delete_key``.

    Args:
        store: the store the values live in.
        secret: the job secret.
        where: the store's address, for the log line on a forged value.
    """

    def __init__(self, store: dist.Store, secret: bytes, where: str = "the job's store") -> None:
        super().__init__()
        self.inner = store
        self._raw: Any = store  # takes bytes where torch's stubs say str
        self._secret = secret
        self._where = where
        self._names: dict[str, str] = {}
        self._forged: set[str] = set()  # keys a forged value was read under (said once each)

    @property
    def where(self) -> str:
        """The store's address, as the log lines name it."""
        return self._where

    @property
    def mark(self) -> str:
        """This store's secret's mark (:func:`secret_mark`)."""
        return secret_mark(self._secret)

    def name(self, key: str) -> str:
        """The name ``key`` has in the store."""
        name = self._names.get(key)
        if name is None:
            digest = hmac.new(self._secret, b"name\x00" + key.encode(), hashlib.sha256).hexdigest()
            name = self._names[key] = f"tandem/s/{digest[:32]}"
        return name

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, b"value\x00" + key.encode() + b"\x00" + value, hashlib.sha256).hexdigest() \
            .encode()

    def _sign(self, key: str, value: str | bytes) -> bytes:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(key, raw) + _SEP + raw

    def _open(self, key: str, signed_value: bytes) -> bytes:
        mac, sep, raw = bytes(signed_value).partition(_SEP)
        if not sep or len(mac) != 2 * _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, raw)):
            if key not in self._forged:  # once a key: a stranger may write it as fast as it likes
                self._forged.add(key)
                logger.warning("tandem: refused a value under %r in %s: it is not signed with this job's secret "
                               "(written by a process outside the job); more under this key are refused "
                               "silently", key, self._where)
            raise ForgedValueError(f"the value under {key!r} in {self._where} is not signed with this job's "
                                   "secret: a process outside the job wrote it, and it was refused")
        return raw

    # ------------------------------------------------------------------ the store's calls
    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._raw.set(self.name(key), self._sign(key, value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self._open(key, self.inner.get(self.name(key)))

    def check(self, keys: Sequence[str]) -> bool:  # type: ignore[override]
        return bool(self.inner.check([self.name(k) for k in keys]))

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return int(self.inner.add(self.name(key), amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # type: ignore[override]
        expected_raw = expected.encode() if isinstance(expected, str) else bytes(expected)
        current = self._raw.compare_set(self.name(key), self._sign(key, expected) if expected_raw else b"",
                                        self._sign(key, desired))
        return self._open(key, current) if current else b""

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # type: ignore[override]
        return [self._open(k, v) for k, v in zip(keys, self.inner.multi_get([self.name(k) for k in keys]))]

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:  # type: ignore[override]
        names = [self.name(k) for k in keys]
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return bool(self.inner.delete_key(self.name(key)))

    def num_keys(self) -> int:  # type: ignore[override]
        return int(self.inner.num_keys())

    def over(self, store: dist.Store) -> SignedStore:
        """``store`` (another client of the same store, say) signing as this one does."""
        return SignedStore(store, self._secret, self._where)


MANY_NODES_NEED_A_SECRET = (
    "a job of several nodes needs one job secret shared by every node, and none is set: make one with "
    "python -c 'import secrets; print(secrets.token_hex(32))' > ~/.tandem-secret; chmod 600 ~/.tandem-secret, "
    f"then export {SECRET_FILE_ENV}=~/.tandem-secret (or {SECRET_ENV}=<the secret>) on every node before "
    "the launch (tandem run, torchrun or srun; docs: Who can join a job)")


def secret_for_workers(nodes: int, environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, str]:
    """What a launcher adds to its workers' environment so that they share a job
    secret: nothing when its own environment has one (the workers inherit it), a
    new one for a job of one node (Note [signed store]).

    Raises:
        ValueError: a job of several nodes without a secret (each node would make
            its own; every node must be given the same), or the environment's
            secret is empty or its file unreadable; the message says what to do.
    """
    if job_secret(environ) is not None:
        return {}
    if nodes > 1:
        raise ValueError(MANY_NODES_NEED_A_SECRET)
    return {SECRET_ENV: new_secret()}


def signed_like(template: dist.Store, store: dist.Store) -> dist.Store:
    """``store`` signing as ``template`` does: over a :class:`SignedStore`, one with
    its secret; else ``store`` as it is."""
    return template.over(store) if isinstance(template, SignedStore) else store


def signed(store: dist.Store, *, where: str = "the job's store",
           environ: dict[str, str] | os._Environ[str] | None = None) -> dist.Store:
    """``store`` as a :class:`SignedStore` when the job has a secret (:func:`job_secret`), else as it is."""
    secret = job_secret(environ)
    return store if secret is None else SignedStore(store, secret, where)
