"""The engine core: every engine-side decision of p2pweights, once (``core.py``: the rules of every
verb; ``session.py``: the owner, lease and torn mark; ``steps.py``: what the core asks its host to do;
``rank_area.py``: a rank's delta area and its apply). Our receiver, the sglang plugin and the vLLM backend
host it and decide nothing (docs/architecture.md, "One engine core, three hosts")."""
