"""``receipts check``: can this pod reach what a worker needs? (install day, ``helm test``)

Two checks, one line each on stdout:

* **database**: connect as the worker does and read the schema version; it passes when
  this version can run on the schema (current, or a later release's of the same major
  version: :attr:`receipts.migrate.SchemaStatus.usable`).
* **provider**: one ``OPTIONS`` request to ``RECEIPTS_PROVIDER_URL`` through the delivery
  client (:meth:`receipts.delivery.HttpDeliverer.reach`: its TLS settings, proxy and
  token). An HTTP answer proves the way there works (a provider need not allow
  ``OPTIONS``: 404, 405 or 501 are answers; a 404 passes with a word on the URL's path,
  which may name no endpoint), except: 401 and 403, the provider refuses the
  token; 407, the egress proxy refuses its credentials (RFC 9110 §15.5.8); 500, 502, 503 and
  504, the provider, or a gateway on the way to it, is not serving (RFC 9110 §15.6).

Nothing is written and no receipt is sent. Messages carry no password or token: the
database's are redacted, the provider's name only its scheme, host and path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from receipts.db import connect
from receipts.dsn import redact_dsn
from receipts.errors import QueueError
from receipts.migrate import schema_status_async
from receipts.runtime import make_deliverer
from receipts.settings import Settings, SettingsError
from receipts.transport import TransportError

#: Answers that reach a server but prove no receipt could be delivered: an internal error,
#: a gateway that could not reach the provider or waited in vain for it, and "unavailable".
#: 501 (Not Implemented) is not among them: a provider may not implement OPTIONS.
NOT_SERVING = frozenset({500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's outcome: *name* (``database``, ``provider``), whether it passed, and a
    one-line *detail* (what was found, or why it failed)."""

    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        """``name: ok|FAILED: detail``."""
        return f"{self.name}: {'ok' if self.ok else 'FAILED'}: {self.detail}"


async def check_database(settings: Settings) -> CheckResult:
    """Connect with the worker's settings and judge the schema (see the module doc)."""
    try:
        conn = await connect(settings, "check")
        async with conn:
            status = await schema_status_async(conn, schema=settings.db_schema)
    except QueueError as exc:
        return CheckResult("database", False, redact_dsn(str(exc)))
    return CheckResult("database", status.usable,
                       f"{settings.safe_dsn}: {status.describe()}")


async def check_provider(settings: Settings) -> CheckResult:
    """Send one ``OPTIONS`` request to the provider URL (see the module doc)."""
    where = settings.safe_provider_url
    if not settings.provider_url:
        return CheckResult("provider", False, "RECEIPTS_PROVIDER_URL is not set (the URL "
                                              "receipts are POSTed to)")
    try:
        deliverer = make_deliverer(settings)
    except SettingsError as exc:
        return CheckResult("provider", False, str(exc))
    start = time.monotonic()
    try:
        status = await deliverer.reach()
    except TimeoutError:
        return CheckResult("provider", False, f"{where}: no answer within "
                                              f"{settings.delivery_timeout_seconds:g}s")
    except (TransportError, OSError) as exc:
        text = str(exc).strip() or type(exc).__name__
        return CheckResult("provider", False, f"{where}: {type(exc).__name__}: {text[:200]}")
    finally:
        await deliverer.aclose()
    took = f"HTTP {status} in {time.monotonic() - start:.2f}s"
    if status in (401, 403):
        return CheckResult("provider", False, f"{where}: {took}: the provider refuses our "
                                              "token (RECEIPTS_PROVIDER_TOKEN)")
    if status == 407:
        return CheckResult("provider", False, f"{where}: {took}: the egress proxy refuses "
                                              "its credentials (the user and password of "
                                              "RECEIPTS_PROVIDER_PROXY or HTTP(S)_PROXY)")
    if status in NOT_SERVING:
        return CheckResult("provider", False, f"{where}: {took}: the provider, or a gateway "
                                              "on the way to it, is not serving")
    if status == 404:
        # Some providers answer 404 to a method they lack; others mean the path is wrong,
        # and every receipt POSTed there would be rejected (the fleet would pause).
        return CheckResult("provider", True, f"{where}: reachable ({took}); check the path "
                                             "of RECEIPTS_PROVIDER_URL: 404 may mean no "
                                             "such endpoint, not only no OPTIONS")
    return CheckResult("provider", True, f"{where}: reachable ({took})")


async def run_checks(settings: Settings) -> list[CheckResult]:
    """Both checks, database first."""
    return [await check_database(settings), await check_provider(settings)]
