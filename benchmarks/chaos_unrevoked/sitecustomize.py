"""``benchmarks/chaos.py --unfenced --unrevoked``: the harness's self-check, loaded by the ENGINE
processes only (chaos.py puts this folder first on their PYTHONPATH with ``CHAOS_UNREVOKED=1``; the
senders get neither). It switches the engine's revocation off (``transport/revocation.py``): at a
takeover the ranks still open the next epoch's endpoint and publish it, but the old endpoint is
neither fenced (regions unregistered, connections cut) nor closed, so a late sender's writes to it
still land. A run with late faults must then count wrong bytes served. Nothing of the library is
changed; without the variable this file does nothing."""
import os

if os.environ.get("CHAOS_UNREVOKED") == "1":
    try:
        from p2pweights.transport import revocation as _revocation

        _revocation.RevocableRegions._fence = lambda self, old, epoch, timeout: 0
        _KEPT: list = []  # the old endpoints, alive (dropped, the native endpoint would close as it is freed)
        _revocation.RevocableRegions._close_old = lambda self, old, epoch: _KEPT.append(old)
        print(f"chaos --unrevoked: revocation off in pid {os.getpid()}", file=__import__("sys").stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - an interpreter without the package: nothing to switch off
        print(f"chaos --unrevoked: not switched off in pid {os.getpid()}: {e}", file=__import__("sys").stderr)
