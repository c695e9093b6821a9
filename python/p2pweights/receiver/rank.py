"""One engine rank in this process (:class:`EngineRank`): sglang's model of the rank with its
parameters in one registered region, its publication, the update session's begin/end, the
equality check and checksum, and sglang's broadcast path through a :class:`BroadcastReceiver`.

The broadcast path is a plug-in: the rank is given a :class:`BroadcastReceiver` object, or None
(those routes then fail). The rank process (:mod:`.rank_process`) chooses it: the broadcast
baseline's ``GroupReceiver`` unless started with ``--broadcast-receiver none``.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from ..control.weights_digest import parameter_digests
from ..deltas.area import open_rank_area
from ..engine.rank_area import RankDeltas
from ..errors import UnknownParameter
from ..models.engine_layout import EngineLayout
from ..models.sglang_version import sglang_version
from ..replica import sglang_env
from ..replica.reference import ReferenceModel, named_state, tensor_bytes
from ..replica.sglang_ue8m0 import post_process_as_loaded
from ..settings import value as setting
from ..transport import params_table
from ..transport.revocation import RevocableRegions
from .adapter_pool import PREFIX as ADAPTER_PREFIX
from .adapter_pool import AdapterPool
from .build_report import device_arch
from .draft_role import draft_role, split_names
from .region import place_parameters
from .update_hooks import UpdateHooks

if TYPE_CHECKING:
    import torch


class BroadcastReceiver(Protocol):
    """How an engine rank takes part in sglang's broadcast path (``/init_weights_update_group``,
    ``/update_weights_from_distributed``, ``/destroy_weights_update_group``)."""

    def join(self, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
             group_name: str, timeout: float) -> Any:
        """Join the weight-update group as ``rank`` (group rank 0 is the sender); return its handle."""

    def receive(self, group: Any, tensor: "torch.Tensor") -> None:
        """Receive group rank 0's next broadcast into ``tensor``."""

    def leave(self, group: Any) -> None:
        """Leave the group."""


class EngineRank:
    """One engine rank in this process: the live model in one registered region, its publication,
    its post-processing, the equality check and the broadcast path."""

    def __init__(self, config: str, engine: Any, rank: int, transport: str = "mooncake", name: str = "engine",
                 broadcast: BroadcastReceiver | None = None, lora: Any = None):
        t0 = time.perf_counter()
        self.config = os.fspath(config)
        self.engine = engine if isinstance(engine, EngineLayout) else EngineLayout.parse(str(engine))
        self.rank = int(rank)
        self.name = name
        self.transport = transport
        if not 0 <= self.rank < self.engine.world_size:
            raise ValueError(f"rank {rank} is not a rank of an engine of {self.engine.world_size} ranks")
        self.device = rank_device(self.rank)
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(self.device))
        self.model = sglang_env.build_model(self.config, self.engine, self.rank, device="meta")
        if self.engine.gpu_arch is not None:  # a Blackwell rank: its parameters as sglang's post-processing left them
            post_process_as_loaded(self.model, self.engine)
        self.region = place_parameters(self.model, device=self.device)
        # speculative decoding: sglang's draft model too, its own parameters in a region of their own
        # and published as "draft.<name>"; its embedding and head are the target's (draft_role.py)
        self.draft = draft_role(self.config, self.engine, self.rank, self.model, self.device)
        regions = [self.region] + ([self.draft.region] if self.draft is not None else [])
        self.weight_regions = [(r.address, r.nbytes) for r in regions]
        # LoRA (lora: a LoRASetting): sglang's adapter pool in a region of its own (adapter_pool.py)
        self.adapters = AdapterPool(self.config, self.engine, self.rank, lora, self.device) if lora else None
        # the rank's delta area (deltas/area.py), next to its weights: host memory or this GPU's
        self.deltas = RankDeltas(open_rank_area(sum(r.nbytes for r in regions), self.device, self.rank, name),
                                 self.rank, name, self.device)
        self.deltas.cover(self.weight_regions, tensors=[r.storage for r in regions])  # records go through them
        self.delta_area = self.deltas.area
        table = [*self.model.named_parameters(), *(self.draft.published() if self.draft is not None else []),
                 *(self.adapters.published() if self.adapters is not None else [])]
        arch, version = device_arch(self.device, self.engine.gpu_arch), sglang_version() or ""

        area = self.delta_area.region() if self.delta_area is not None else None

        def build(publication: Any) -> None:
            # this rank's build: senders refuse a version or architecture their replica does not reproduce
            publication.device_arch, publication.sglang_version = arch, version
            publication.delta_area = area[:2] if area is not None else None

        # the registrations (the delta area's too), revocable per epoch (transport/revocation.py): a
        # takeover moves them to a new endpoint
        self.registrations = RevocableRegions(
            transport, [(r.address, r.nbytes, self.device) for r in regions] + ([area] if area else [])
            + ([(self.adapters.address, self.adapters.nbytes, self.device)] if self.adapters is not None else []),
            params_table(table), self.rank, decorate=build)
        # sglang's restore and post-processing at begin and end, skipped once proven no-ops here
        self.update_hooks = UpdateHooks([self.model] + ([self.draft.model] if self.draft is not None else []),
                                        self.device, name, self.rank, prove=setting("P2PW_RECEIVER_CONTROL") == "folded")
        self.update_hooks.prove_at_start()  # now, before the rank reports ready: not in its first update (update_hooks.py)
        self.reference = ReferenceModel(self.config, self.engine, self.rank)
        self.loaded_weights = False   # a loader ran in this session (the broadcast path)
        self._broadcast = broadcast
        self._groups: dict[str, Any] = {}
        self._group_devices: dict[str, str] = {}  # where a group's broadcast tensors land (nccl: this GPU)
        self._lock = threading.RLock()
        self.startup_seconds = time.perf_counter() - t0

    # -- what is published ---------------------------------------------------------------------
    @property
    def publication(self) -> Any:
        """What this rank publishes now (its current epoch's endpoint)."""
        return self.registrations.publication

    def revoke(self, epoch: int) -> dict:
        """A takeover: the regions move to a new endpoint published under ``epoch``; the old one's
        connections and keys fail. Answers the new publication (as the ``publication`` verb)."""
        with self._lock:
            self.registrations.revoke(int(epoch))
        peer, table, extra = self.published()
        return {"peer": peer, "table": table, "extra": extra, "seconds": self.registrations.revoke_seconds}

    def published(self) -> tuple[str, dict, dict]:
        """(session id / agent name, sglang's weights table, extra publication keys such as NIXL's)."""
        d = self.publication.to_dict()
        peer, table = d.pop("remote_instance_transfer_engine_info")
        d.pop("rank", None)
        return peer, table, d

    # -- the update session ----------------------------------------------------------------------
    def adapter(self, body: dict) -> dict:
        """The engine's LoRA registry on this rank: ``op`` load (``lora_name``, ``lora_path``,
        ``pinned``), unload or slot; answers the adapter's slot."""
        if self.adapters is None:
            raise UnknownParameter(f"engine {self.name} rank {self.rank} was started without LoRA: no adapter pool",
                                   engine=self.name, rank=self.rank, parameter=str(body.get("lora_name")),
                                   hint="start it with a LoRA setting (p2pweights serve --lora R)")
        name, op = str(body["lora_name"]), body.get("op")
        with self._lock:
            if op == "load":
                return {"slot": self.adapters.load(name, str(body["lora_path"]), bool(body.get("pinned", True)))}
            if op == "unload":
                self.adapters.unload(name)
                return {"slot": None}
            return {"slot": self.adapters.slot(name)}

    def begin(self, selector: str = "all") -> dict:
        """sglang's begin_weight_update: restore_weights_before_loading on every model (skipped once
        proven a no-op on this rank: update_hooks.py)."""
        with self._lock:
            skipped = self.update_hooks.begin()
            self.loaded_weights = False
        return {"rank": self.rank, "hooks": "skipped" if skipped else "ran", "traced": self.update_hooks.traced}

    def end(self) -> dict:
        """sglang's end_weight_update: post_load_weights (unless a loader ran, which did it) and
        process_weights_after_loading of every module with a quant method (skipped once proven a
        no-op on this rank: update_hooks.py)."""
        with self._lock:
            skipped = self.update_hooks.end(self.loaded_weights)
            self.loaded_weights = False
        return {"rank": self.rank, "hooks": "skipped" if skipped else "ran"}

    def apply_deltas(self, manifests: dict) -> dict:
        """The session's deltas for this rank (its manifest in ``manifests``; none: nothing to apply),
        checked whole, then applied into the weights: before ``end``'s post-processing."""
        with self._lock:
            return self.deltas.apply(manifests)

    # -- checks ------------------------------------------------------------------------------------
    def compare(self, hf_seed: int, skip: Sequence[str] = (), *, changed: tuple[float, int] | None = None) -> dict:
        """The live weights against sglang's loader on ``random_checkpoint(specs, hf_seed, changed=changed)``."""
        with self._lock:
            result = self.reference.compare(self.model, int(hf_seed), skip, changed=changed)
            if self.draft is not None:  # the draft against sglang's draft tied to the target's reference
                self.draft.compare_into(result, self.reference.model, int(hf_seed), skip, changed=changed)
            return result.to_dict()

    def checksum(self) -> dict:
        h = hashlib.sha256()
        with self._lock:
            state = {**named_state(self.model), **(self.draft.named_state() if self.draft is not None else {})}
            for name, t in sorted(state.items()):
                h.update(name.encode())
                h.update(tensor_bytes(t).cpu().numpy().tobytes())
        return {"rank": self.rank, "checksum": h.hexdigest()}

    def digest(self, names: Sequence[str]) -> dict[str, str]:
        """The digest of the bytes this rank holds for each named parameter (``verify=True``)."""
        adapters = [n for n in names if n.startswith(ADAPTER_PREFIX)]  # "lora.<buffer>@<slot>": adapter slots
        target, draft = split_names([n for n in names if not n.startswith(ADAPTER_PREFIX)])  # "draft.": the draft's
        with self._lock:
            digests = parameter_digests(self.model, target, engine=self.name, rank=self.rank)
            if adapters:
                if self.adapters is None:
                    raise UnknownParameter(f"engine {self.name} rank {self.rank} has no LoRA pool (adapter slot "
                                           f"{adapters[0]!r})", engine=self.name, rank=self.rank, parameter=adapters[0])
                digests.update(self.adapters.digest(adapters, self.name))
            if draft and self.draft is not None:
                digests.update(self.draft.digest(draft, self.name))
            elif draft:
                digests.update(parameter_digests(self.model, draft, engine=self.name, rank=self.rank))  # names them
            return digests

    def weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        if self.draft is not None and name.startswith("draft."):
            return self.draft.weights_by_name(name, truncate_size)
        params = dict(self.model.named_parameters())
        if name not in params:
            return None
        return params[name].detach()[:truncate_size].float().tolist()

    # -- the broadcast path ------------------------------------------------------------------------
    def broadcast_receiver(self) -> BroadcastReceiver:
        if self._broadcast is None:
            raise RuntimeError(f"engine {self.name} rank {self.rank} has no broadcast receiver (its rank "
                               f"processes were started with --broadcast-receiver none)")
        return self._broadcast

    def init_group(self, request: dict) -> None:
        name = request["group_name"]
        if self.engine.gpu_arch is not None:  # before joining: no collective waits on a rank that cannot load
            raise RuntimeError(f"engine {self.name} rank {self.rank} holds an {self.engine.gpu_arch} rank's "
                               "post-processed layout (packed UE8M0 scales), which sglang's loaders cannot load "
                               "again: the broadcast path is not supported there; write it with a WeightSender")
        if name in self._groups:
            raise RuntimeError(f"group {name!r} already exists on rank {self.rank}")
        self._group_devices[name] = self.device if request["backend"] == "nccl" else "cpu"
        self._groups[name] = self.broadcast_receiver().join(
            request["backend"], request["master_address"], int(request["master_port"]), int(request["world_size"]),
            int(request["rank_offset"]) + self.rank, name, float(request.get("timeout", 120.0)))

    def update_from_distributed(self, request: dict) -> None:
        import torch

        group = self._groups.get(request["group_name"])
        if group is None:
            raise RuntimeError(f"group {request['group_name']!r} is not initialized on rank {self.rank}; "
                               f"call init_weights_update_group first")
        receiver = self.broadcast_receiver()
        weights = []
        for name, dtype, shape in zip(request["names"], request["dtypes"], request["shapes"]):
            t = torch.empty([int(s) for s in shape], dtype=getattr(torch, str(dtype).removeprefix("torch.")),
                            device=self._group_devices.get(request["group_name"], "cpu"))
            receiver.receive(group, t)
            weights.append((name, t))
        with self._lock, sglang_env.activate(self.model):
            self.update_hooks.loader_ran()  # before it runs: a failed load is no proof either
            self.model.load_weights(weights)
            if self.draft is not None:  # sglang: every selected runner loads what the target received
                self.draft.load_weights(weights)
            self.loaded_weights = True

    def destroy_group(self, group_name: str) -> None:
        group = self._groups.pop(group_name, None)
        if group is None:
            raise RuntimeError(f"the group {group_name!r} does not exist on rank {self.rank}")
        self.broadcast_receiver().leave(group)

    def close(self) -> None:
        for name in list(self._groups):
            try:
                self.destroy_group(name)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        try:
            self.registrations.close()
        except Exception:  # noqa: BLE001
            pass
        self.deltas.close()

    # -- the verbs a leader calls on each rank (same names over HTTP) -------------------------------
    def call(self, verb: str, body: dict) -> Any:
        if verb == "begin":
            return self.begin(body.get("selector", "all"))
        if verb == "end":  # the session's deltas first (when the end carries them), then the post-processing
            applied = self.apply_deltas(body["manifests"]) if body.get("manifests") is not None else None
            return {**self.end(), **({"deltas": applied} if applied is not None else {})}
        if verb == "compare":  # changed_fraction and changed_steps: both or neither (RankCompareReq)
            changed = body.get("changed_fraction"), body.get("changed_steps")
            return self.compare(int(body["hf_seed"]), body.get("skip") or (),
                                changed=None if None in changed else (float(changed[0]), int(changed[1])))
        if verb == "checksum":
            return self.checksum()
        if verb == "adapter":
            return self.adapter(body)
        if verb == "digest":
            return self.digest((body.get("names") or {}).get(str(self.rank), []))
        if verb == "init_group":
            return self.init_group(body)
        if verb == "update_from_distributed":
            return self.update_from_distributed(body)
        if verb == "destroy_group":
            return self.destroy_group(body["group_name"])
        if verb == "apply_deltas":
            return self.apply_deltas(body.get("manifests"))
        if verb == "revoke":
            return self.revoke(int(body["epoch"]))
        if verb == "ping":
            return {"rank": self.rank, "pid": os.getpid()}
        if verb == "publication":  # the leader checks a registration against it (registration.check_claim)
            peer, table, extra = self.published()
            return {"peer": peer, "table": table, "extra": extra}
        raise KeyError(f"unknown rank verb {verb!r}")


def rank_device(rank: int) -> str:
    """Where engine rank ``rank`` keeps its parameters: ``P2PW_RECEIVER_GPUS`` ("1,2,3,4": rank r on
    GPU number r of the list) wins over ``P2PW_RECEIVER_DEVICE`` (cpu, cuda = cuda:0, cuda:N)."""
    gpus = setting("P2PW_RECEIVER_GPUS")
    if gpus:
        listed = gpus.split(",")
        if rank >= len(listed):
            raise ValueError(f"P2PW_RECEIVER_GPUS={gpus!r} names {len(listed)} GPU(s); engine rank {rank} needs one")
        return f"cuda:{listed[rank]}"
    device = setting("P2PW_RECEIVER_DEVICE")
    return "cuda:0" if device == "cuda" else device
