"""A stand-in engine rank for the transport tests, as a script: registers a region with Mooncake or
NIXL, prints its publication, checks bytes on request. The code is p2pweights.transport.peer (the
benchmark uses it too); see its docstring for the line protocol.

    python tests/transport_peer.py --transport nixl --size 256MiB --params 16 --gap 4096
"""
import sys

from p2pweights.transport.peer import main

if __name__ == "__main__":
    sys.exit(main())
