"""What the demo's roles agree on without talking: contracts, rooms, prompt lengths.

A Prefill rank and a Decode rank of the demo run in separate processes (possibly
of different implementations). They agree on the request stream by construction:
the same ``--rooms`` range in the same order, and each room's prompt length drawn
from ``(seed, room)``. The KV bytes and the bootstrap token follow the interop
pattern (docs/protocol.md#proto-interop), so the Decode side can check every byte it
received.

Contracts: :func:`demo_contract` — per layer a K and a V field laid out
head-major, ``(heads, page_tokens, head_dim)``, partitioned on the head axis — or
a contract file a rank is given (``--contract``). Head-major matters for
heterogeneous TP: a Prefill rank's share of a Decode page is then one contiguous
run per field and page, where a token-major layout (``(page_tokens, heads,
head_dim)``) cuts it into one small row per token, and Mooncake over TCP pays
about 40 µs per descriptor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from tspd.core.contract import CacheContract, check_local_contract, parse_contract
from tspd.core.errors import ConfigError, ContractError
from tspd.layouts import kv_heads_per_rank, mha_contract

__all__ = [
    "DEFAULT_SPEC_CANDIDATES",
    "MAX_SPEC_CANDIDATES",
    "Workload",
    "check_spec_candidates",
    "demo_contract",
    "parse_rooms",
]

#: Speculative candidate ids sent (Prefill) and expected (Decode) with each bootstrap
#: token by default. TokenSpeed's interop peers take theirs as an option
#: (``--spec-candidates`` / ``--expect-spec``) and face the demo with 2.
DEFAULT_SPEC_CANDIDATES = 2
#: The most a demo rank sends or expects: every status message carries them as one
#: int32 frame, and speculative decoders draft far fewer.
MAX_SPEC_CANDIDATES = 1024


def demo_contract(
    *,
    layers: int,
    num_pages: int,
    heads: int,
    head_dim: int,
    page_tokens: int,
    tp_size: int,
    global_heads: int,
    dtype: str = "bfloat16",
) -> CacheContract:
    """One TP rank's KV cache: group ``"kv"`` (full history, ``page_tokens`` tokens a
    page) with fields ``layer.<L>.k`` / ``layer.<L>.v`` of local shape
    ``(heads, page_tokens, head_dim)``, each in its own plane, partitioned on axis 0
    with ``global_heads`` in all (:func:`tspd.layouts.mha_contract`, head-major)."""
    if heads != kv_heads_per_rank(global_heads, tp_size):
        raise ConfigError(
            f"{heads} local KV heads on TP={tp_size} cannot hold {global_heads} global heads"
        )
    return mha_contract(
        num_layers=layers,
        num_kv_heads=global_heads,
        head_dim=head_dim,
        page_tokens=page_tokens,
        num_pages=num_pages,
        dtype=dtype,
        tp_size=tp_size,
        token_layout="head_major",
    )


def parse_rooms(text: str) -> range:
    """``A:B`` → rooms ``A, A+1, …, B-1``; a single ``A`` → just ``A``."""
    try:
        if ":" in text:
            first, _, stop = text.partition(":")
            rooms = range(int(first), int(stop))
        else:
            rooms = range(int(text), int(text) + 1)
    except ValueError:
        raise ConfigError(f"rooms must be 'A:B' (rooms A..B-1), got {text!r}") from None
    if not rooms or rooms.start < 0 or rooms.stop - 1 > 2**63 - 1:
        raise ConfigError(f"rooms {text!r} must be a non-empty range inside [0, 2^63-1]")
    return rooms


def check_spec_candidates(count: int) -> int:
    """``count`` if it is a valid number of speculative candidates, else
    :class:`ConfigError` saying what is accepted."""
    if not 0 <= count <= MAX_SPEC_CANDIDATES:
        raise ConfigError(
            f"--spec-candidates must be between 0 and {MAX_SPEC_CANDIDATES} (speculative "
            f"candidate ids sent with each bootstrap token; 0 sends none), got {count}; "
            "use the same value as the peer you face"
        )
    return count


@dataclass(frozen=True, slots=True)
class Workload:
    """The request stream and cache geometry both sides of the demo use.

    ``max_prompt_pages`` bounds a prompt's pages (each room gets 1..max pages
    worth of tokens); ``fixed_prompt_pages`` gives every room exactly that many
    (the benchmarks). ``candidates`` is the number of speculative candidates sent
    (Prefill) and expected (Decode) with each bootstrap token, 0 to
    :data:`MAX_SPEC_CANDIDATES` (``--spec-candidates``).
    """

    rooms: range
    seed: int = 0
    layers: int = 2
    global_heads: int = 4
    head_dim: int = 64
    page_tokens: int = 16
    num_pages: int = 2048
    dtype: str = "bfloat16"
    max_prompt_pages: int = 8
    fixed_prompt_pages: int | None = None
    candidates: int = DEFAULT_SPEC_CANDIDATES
    contract_file: str | None = None

    def __post_init__(self) -> None:
        check_spec_candidates(self.candidates)

    def contract(self, tp_size: int) -> CacheContract:
        """This workload's contract for a rank of a TP group of ``tp_size``."""
        if self.contract_file is not None:
            # This rank's own contract: held to tspd's local checks, not only S1's.
            try:
                contract = parse_contract(Path(self.contract_file).read_bytes())
                check_local_contract(contract)
            except ContractError as err:
                cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
                raise ContractError(f"--contract {self.contract_file}: {err}{cause}") from err
            return contract
        # More ranks than KV heads: each rank holds one head and ranks replicate
        # heads (GQA), which gives the Prefill side dummy ranks (docs/protocol.md#proto-dummies).
        heads = kv_heads_per_rank(self.global_heads, tp_size)
        return demo_contract(
            layers=self.layers,
            num_pages=self.num_pages,
            heads=heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            tp_size=tp_size,
            global_heads=self.global_heads,
            page_tokens=self.page_tokens,
        )

    def prompt_len(self, room: int, contract: CacheContract) -> int:
        """Room ``room``'s prompt length in tokens (the same on every rank)."""
        grain = min(spec.block_granularity for spec in contract.group_specs)
        if self.fixed_prompt_pages is not None:
            return self.fixed_prompt_pages * grain
        digest = hashlib.blake2b(f"{self.seed}:{room}".encode(), digest_size=8).digest()
        return 1 + int.from_bytes(digest, "little") % (self.max_prompt_pages * grain)

    @staticmethod
    def rid(room: int) -> str:
        """The request id both sides use for ``room``."""
        return f"room-{room}"
