"""The sans-IO bootstrap server state and its client payloads
(docs/protocol.md#proto-bootstrap)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.bootstrap import (
    BAD_LAYOUT,
    INCOMPATIBLE_LAYOUTS,
    LAYOUT_NOT_STRING,
    MAX_WORLD_SIZE,
    METHOD_NOT_ALLOWED,
    MISSING_INPUTS,
    REFUSAL_REASONS,
    BootstrapState,
    ParallelInfo,
    RankInfo,
    build_route_payload,
    encode_route_payload,
    is_valid_host,
    parse_parallel_info,
    parse_rank_info,
    parse_route_payload,
)
from tspd.core.contract import parse_contract
from tspd.core.errors import WireError


def contract_json(fields: tuple[str, ...] = ("layer.0.kv",), *, indent: int | None = 1) -> str:
    """A small valid contract, pretty-printed (not canonical) unless ``indent=None``."""
    return json.dumps(
        {
            "plan": {
                "prefix_granularity": 16,
                "lcm_block_bytes": 4096 * len(fields),
                "num_lcm_blocks": 8,
                "groups": [{"group_id": "full", "cache_blocks_per_lcm_block": 1, "page_count": 9}],
                "planes": [
                    {
                        "plane_id": "p0",
                        "bytes_per_lcm_block": 4096 * len(fields),
                        "arena_offset_bytes": 0,
                    }
                ],
                "fields": [
                    {
                        "group_id": "full",
                        "field_id": fid,
                        "plane_id": "p0",
                        "shape": [1024],
                        "dtype": "float32",
                        "field_offset_bytes": 4096 * i,
                        "page_stride_bytes": 4096 * len(fields),
                    }
                    for i, fid in enumerate(fields)
                ],
                "an_ignored_key": 1,
            },
            "group_specs": [
                {
                    "group_id": "full",
                    "retention": "full_history",
                    "rows_per_page": 16,
                    "entry_stride_tokens": 1,
                    "sliding_window_tokens": None,
                    "family": "history",
                    "transfer_policy": "full_suffix",
                    "checkpoint_granularity": None,
                }
            ],
            "transfer_schema": {"fields": []},
        },
        indent=indent,
    )


LAYOUT = contract_json()
CANONICAL = parse_contract(LAYOUT).to_json().decode("ascii")


def put(
    state: BootstrapState,
    engine_rank: int,
    *,
    world_size: int = 2,
    dp_size: int = 1,
    layout: Any = LAYOUT,
    **extra: Any,
) -> tuple[int, str]:
    body = {
        "role": "Prefill",
        "world_size": world_size,
        "dp_size": dp_size,
        "rank_ip": "127.0.0.1",
        "rank_port": 7000 + engine_rank,
        "engine_rank": engine_rank,
        "cache_layout": layout,
        **extra,
    }
    reply = state.handle("PUT", "/route", {}, json.dumps(body).encode())
    return reply.status, reply.body


def get(state: BootstrapState, engine_rank: str, dp_group: str) -> tuple[int, str]:
    reply = state.handle(
        "GET", "/route", {"engine_rank": engine_rank, "target_dp_group": dp_group}, b""
    )
    return reply.status, reply.body


def test_health_is_ok_before_any_rank() -> None:
    reply = BootstrapState().handle("GET", "/health", {}, b"")
    assert (reply.status, reply.body) == (200, "OK")


def test_other_methods_on_route_get_405_json() -> None:
    for method in ("POST", "DELETE", "PATCH"):
        reply = BootstrapState().handle(method, "/route", {}, b"")
        assert (reply.status, reply.body) == (405, METHOD_NOT_ALLOWED)
        assert reply.content_type == "application/json"


def test_head_on_route_answers_like_get() -> None:
    reply = BootstrapState().handle("HEAD", "/route", {}, b"")
    assert (reply.status, reply.body) == (400, MISSING_INPUTS)


def test_unknown_path_is_404() -> None:
    assert BootstrapState().handle("GET", "/nope", {}, b"").status == 404


def test_put_stores_canonical_layout_and_parallel_info() -> None:
    state = BootstrapState()
    assert put(state, 0) == (200, "OK")
    assert put(state, 1) == (200, "OK")
    status, body = get(state, "-1", "-1")
    assert status == 200
    info = json.loads(body)
    assert info == {"prefill_tp_size": 2, "prefill_dp_size": 1, "cache_layout": CANONICAL}
    assert "an_ignored_key" not in info["cache_layout"]


def test_rank_info_uses_dp_group_and_tp_in_dp() -> None:
    state = BootstrapState()
    for rank in range(4):
        assert put(state, rank, world_size=4, dp_size=2)[0] == 200
    assert json.loads(get(state, "1", "1")[1]) == {"rank_ip": "127.0.0.1", "rank_port": 7003}
    assert json.loads(get(state, "0", "1")[1])["rank_port"] == 7002
    assert json.loads(get(state, "1", "0")[1])["rank_port"] == 7001


def test_missing_or_empty_query_is_400() -> None:
    state = BootstrapState()
    put(state, 0, world_size=1)
    for query in ({}, {"engine_rank": "0"}, {"engine_rank": "", "target_dp_group": "0"}):
        reply = state.handle("GET", "/route", query, b"")
        assert (reply.status, reply.body) == (400, MISSING_INPUTS)


def test_non_integer_ranks_are_400_and_unknown_ranks_404() -> None:
    state = BootstrapState()
    put(state, 0, world_size=1)
    assert get(state, "x", "0")[0] == 400
    assert get(state, "9" * 5000, "0")[0] == 400
    status, body = get(state, "3", "0")
    assert status == 404
    assert "engine_rank=3" in body


def test_gets_answer_503_until_every_rank_registered() -> None:
    state = BootstrapState()
    assert get(state, "-1", "-1") == (503, "Bootstrap server is waiting for its first Prefill rank")
    put(state, 2, world_size=4, dp_size=2)
    waiting = (503, "Bootstrap server is waiting for 3 of 4 Prefill ranks")
    assert get(state, "-1", "-1") == waiting
    assert get(state, "0", "1") == waiting
    put(state, 2, world_size=4, dp_size=2)  # a re-PUT of the same rank counts once
    assert get(state, "-1", "-1") == waiting
    for rank in (0, 1, 3):
        put(state, rank, world_size=4, dp_size=2)
    assert get(state, "-1", "-1")[0] == 200
    assert state.waiting_reason() is None
    assert state.handle("GET", "/health", {}, b"").status == 200


def test_layout_must_be_a_string() -> None:
    state = BootstrapState()
    assert put(state, 0, layout={"plan": {}}) == (400, LAYOUT_NOT_STRING)
    assert put(state, 0, layout=None) == (400, LAYOUT_NOT_STRING)


def test_invalid_layout_is_rejected() -> None:
    assert put(BootstrapState(), 0, layout="{}") == (400, BAD_LAYOUT)
    assert put(BootstrapState(), 0, layout="not json") == (400, BAD_LAYOUT)


def test_incompatible_layout_is_rejected_and_state_kept() -> None:
    state = BootstrapState()
    put(state, 0)
    other = contract_json(("layer.0.k", "layer.0.v"))
    assert put(state, 1, layout=other) == (409, INCOMPATIBLE_LAYOUTS)
    assert state.registered_ranks == 1
    # The same contract in another textual form is compatible.
    assert put(state, 1, layout=contract_json(indent=None)) == (200, "OK")
    assert state.cache_layout == CANONICAL


def test_first_writer_wins_sizes_and_later_puts_overwrite_entries() -> None:
    state = BootstrapState()
    put(state, 0, world_size=2, dp_size=1)
    body = {
        "role": "Prefill",
        "world_size": 2,
        "dp_size": 1,
        "rank_ip": "10.0.0.9",
        "rank_port": 9999,
        "engine_rank": 1,
        "cache_layout": LAYOUT,
    }
    assert state.handle("PUT", "/route", {}, json.dumps(body).encode()).status == 200
    body["rank_port"] = 9998  # the rank restarted on another port
    assert state.handle("PUT", "/route", {}, json.dumps(body).encode()).status == 200
    assert (state.world_size, state.dp_size) == (2, 1)
    assert state.registered_ranks == 2
    assert json.loads(get(state, "1", "0")[1]) == {"rank_ip": "10.0.0.9", "rank_port": 9998}


def test_a_put_with_other_sizes_is_refused_409_and_changes_nothing() -> None:
    state = BootstrapState()
    put(state, 0, world_size=2, dp_size=1)
    before = get(state, "0", "0")
    for world, dp in ((4, 2), (4, 1), (2, 2)):
        status, body = put(state, 1, world_size=world, dp_size=dp)
        assert status == 409
        assert f"world_size={world} and dp_size={dp}" in body
        assert "registered world_size=2 and dp_size=1" in body
    assert (state.world_size, state.dp_size, state.registered_ranks) == (2, 1, 1)
    assert get(state, "0", "0") == before
    # A Decode-role PUT is held to the same sizes (they are the instance's).
    assert put(state, 0, world_size=8, role="Decode")[0] == 409


def test_non_prefill_roles_only_run_the_layout_checks() -> None:
    state = BootstrapState()
    body = {"role": "Decode", "world_size": 1, "dp_size": 1, "cache_layout": LAYOUT}
    assert state.handle("PUT", "/route", {}, json.dumps(body).encode()).status == 200
    assert state.registered_ranks == 0
    body["cache_layout"] = "{}"
    reply = state.handle("PUT", "/route", {}, json.dumps(body).encode())
    assert (reply.status, reply.body) == (400, BAD_LAYOUT)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"role": None}, "'role'"),
        ({"world_size": "2"}, "'world_size'"),
        ({"engine_rank": True}, "'engine_rank'"),
        ({"world_size": 3, "dp_size": 2}, "not a multiple of dp_size=2"),
        ({"engine_rank": 5}, "outside [0, 2)"),
        ({"rank_port": 0}, "unusable control endpoint"),
        ({"rank_ip": ""}, "unusable control endpoint"),
    ],
)
def test_malformed_puts_are_400_and_change_nothing(change: dict[str, Any], needle: str) -> None:
    state = BootstrapState()
    body: dict[str, Any] = {
        "role": "Prefill",
        "world_size": 2,
        "dp_size": 1,
        "rank_ip": "127.0.0.1",
        "rank_port": 7000,
        "engine_rank": 0,
        "cache_layout": LAYOUT,
    }
    body.update(change)
    if change.get("role", "") is None:
        del body["role"]
    reply = state.handle("PUT", "/route", {}, json.dumps(body).encode())
    assert reply.status == 400
    assert reply.reason == "bad_field"
    assert needle in reply.body
    assert state.world_size is None
    assert state.cache_layout is None


def test_put_body_not_json_or_not_object() -> None:
    state = BootstrapState()
    assert state.handle("PUT", "/route", {}, b"\xff{").status == 400
    assert state.handle("PUT", "/route", {}, b"[1]").status == 400


def test_s3_stage_placement_is_validated_and_published() -> None:
    fields = ("layer.0.k", "layer.1.k")
    layout = contract_json(fields)
    state = BootstrapState()
    placement = [["layer.0.k"], ["layer.1.k"]]
    for rank in (0, 1):  # S3: world_size counts the stages too (TP 1 x PP 2)
        status, _ = put(
            state, rank, layout=layout, world_size=2, cache_fields_by_stage=placement, pp_size=2
        )
        assert status == 200
    info = json.loads(get(state, "-1", "-1")[1])
    assert info["prefill_pp_size"] == 2
    assert info["cache_fields_by_stage"] == placement
    cases = [
        ("nope", 2, "CachePD requires explicit stage field placement"),
        ([["layer.0.k"], ["layer.0.k"]], 2, "cache stage placement must cover every logical"),
        ([["layer.0.k"]], 2, "cache stage placement must cover every logical"),
        ([["layer.0.k", "layer.1.k"]], 2, "CachePD placement does not match pipeline stage"),
        ([["layer.1.k"], ["layer.0.k"]], 2, "incompatible field placement"),
    ]
    for bad, pp, needle in cases:
        status, body = put(
            state, 0, layout=layout, world_size=2, cache_fields_by_stage=bad, pp_size=pp
        )
        assert status == (409 if "incompatible" in needle else 400)
        assert needle in body
    # A stage count the world size cannot hold is refused like any other size.
    status, body = put(
        BootstrapState(), 0, layout=layout, world_size=1, cache_fields_by_stage=placement, pp_size=2
    )
    assert status == 400
    assert "pp_size=2 is outside [1, world_size=1]" in body


def test_route_payload_round_trips_into_the_state() -> None:
    payload = build_route_payload(
        rank_ip="127.0.0.1",
        rank_port=5555,
        engine_rank=0,
        world_size=1,
        dp_size=1,
        cache_layout=CANONICAL.encode(),
    )
    body = encode_route_payload(payload)
    assert parse_route_payload(body) == payload
    state = BootstrapState()
    assert state.handle("PUT", "/route", {}, body).status == 200
    info = parse_parallel_info(state.get_route({"engine_rank": "-1", "target_dp_group": "-1"}).body)
    assert info == ParallelInfo(1, 1, CANONICAL)
    assert info.tp_size_per_dp == 1
    rank = parse_rank_info(state.get_route({"engine_rank": "0", "target_dp_group": "0"}).body)
    assert rank == RankInfo("127.0.0.1", 5555)
    assert rank.endpoint == "tcp://127.0.0.1:5555"


def test_s3_payload_builder_adds_stage_keys() -> None:
    payload = build_route_payload(
        rank_ip="h",
        rank_port=1,
        engine_rank=0,
        world_size=2,
        dp_size=1,
        cache_layout="{}",
        cache_fields_by_stage=[("a",), ("b",)],
    )
    assert payload["pp_size"] == 2
    assert payload["cache_fields_by_stage"] == [["a"], ["b"]]


def test_parse_route_payload_rejects_non_objects() -> None:
    with pytest.raises(WireError):
        parse_route_payload(b"[]")
    with pytest.raises(WireError):
        parse_route_payload(b"{")


def test_parallel_info_with_nulls_is_a_wire_error() -> None:
    body = json.dumps({"prefill_tp_size": None, "prefill_dp_size": None, "cache_layout": None})
    with pytest.raises(WireError, match="incomplete parallel info"):
        parse_parallel_info(body)


def test_parallel_info_s3_fields_and_inconsistent_sizes() -> None:
    info = parse_parallel_info(
        json.dumps(
            {
                "prefill_tp_size": 8,
                "prefill_dp_size": 2,
                "cache_layout": "x",
                "prefill_pp_size": 2,
                "cache_fields_by_stage": [["a"], ["b"]],
            }
        )
    )
    assert info.tp_size_per_dp == 2
    assert info.fields_by_stage == (("a",), ("b",))
    with pytest.raises(WireError, match="inconsistent"):
        parse_parallel_info('{"prefill_tp_size": 3, "prefill_dp_size": 2, "cache_layout": "x"}')


def test_rank_info_rejects_bad_endpoints() -> None:
    for body in ('{"rank_ip": "h"}', '{"rank_ip": "", "rank_port": 1}', '{"rank_port": 70000}'):
        with pytest.raises(WireError, match="no usable endpoint"):
            parse_rank_info(body)


@given(st.binary(max_size=200))
def test_reply_parsers_raise_only_wire_errors(data: bytes) -> None:
    for parser in (parse_parallel_info, parse_rank_info, parse_route_payload):
        with contextlib.suppress(WireError):
            parser(data)


@given(
    st.dictionaries(
        st.sampled_from(
            ["role", "world_size", "dp_size", "rank_ip", "rank_port", "engine_rank", "cache_layout"]
        ),
        st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.text(max_size=5)),
    )
)
def test_any_put_object_is_answered_200_or_400(body: dict[str, Any]) -> None:
    state = BootstrapState()
    reply = state.handle("PUT", "/route", {}, json.dumps(body).encode())
    assert reply.status in (200, 400)
    assert reply.status == 200 or reply.reason in REFUSAL_REASONS


def test_deeply_nested_json_is_a_wire_error_not_a_recursion_error() -> None:
    deep = b"[" * 100_000
    for parser in (parse_parallel_info, parse_rank_info, parse_route_payload):
        with pytest.raises(WireError):
            parser(deep)
    assert BootstrapState().handle("PUT", "/route", {}, deep).status == 400


# -- hardening: nothing a client sends is stored unchecked ---------------------------

GOOD_HOSTS = ["localhost", "10.0.0.1", "::1", "2001:db8::7", "prefill-0.svc.local", "a_b.c", "h."]
BAD_HOSTS = [
    "*",
    "",
    "foo bar",
    "a..b",
    "-x",
    "x-",
    "_x",
    "1.2.3",
    "10",
    "256.1.1.1",
    "fe80::1%eth0",
    "[::1]",
    "host\n",
    "h\x00st",
    "hé.example",
    "x" * 254,
    ("a" * 63 + ".") * 4 + "a",
]


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_valid_hosts(host: str) -> None:
    assert is_valid_host(host)


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_invalid_hosts(host: str) -> None:
    assert not is_valid_host(host)


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_a_put_with_an_unusable_rank_ip_is_refused_and_changes_nothing(host: str) -> None:
    state = BootstrapState()
    assert put(state, 0) == (200, "OK")
    before = get(state, "0", "0")
    body = {
        "role": "Prefill",
        "world_size": 2,
        "dp_size": 1,
        "rank_ip": host,
        "rank_port": 7000,
        "engine_rank": 0,
        "cache_layout": LAYOUT,
    }
    reply = state.handle("PUT", "/route", {}, json.dumps(body).encode())
    assert (reply.status, reply.reason) == (400, "bad_field")
    assert "unusable control endpoint" in reply.body
    assert len(reply.body) < 400  # what the client sent is echoed, cut short
    assert get(state, "0", "0") == before
    assert state.registered_ranks == 1


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_a_put_with_a_host_name_or_ip_literal_is_stored(host: str) -> None:
    state = BootstrapState()
    body = {
        "role": "Prefill",
        "world_size": 1,
        "dp_size": 1,
        "rank_ip": host,
        "rank_port": 7000,
        "engine_rank": 0,
        "cache_layout": LAYOUT,
    }
    assert state.handle("PUT", "/route", {}, json.dumps(body).encode()).status == 200
    assert parse_rank_info(get(state, "0", "0")[1]) == RankInfo(host, 7000)


@pytest.mark.parametrize(
    ("world_size", "dp_size", "needle"),
    [
        (2**62, 1, "outside [1, 4096]"),
        (2**70, 2**70, "outside [1, 4096]"),
        (MAX_WORLD_SIZE + 1, 1, "outside [1, 4096]"),
        (0, 1, "outside [1, 4096]"),
        (-4, -2, "outside [1, 4096]"),
        (4, 0, "dp_size=0 is outside [1, world_size=4]"),
        (4, 8, "dp_size=8 is outside [1, world_size=4]"),
        (2048, 1, "2048 TP ranks per DP group, more than 1024"),
    ],
)
def test_a_put_with_unusable_sizes_is_refused_and_keeps_the_table(
    world_size: int, dp_size: int, needle: str
) -> None:
    state = BootstrapState()
    assert put(state, 0, world_size=1) == (200, "OK")
    before = get(state, "0", "0")
    body = {
        "role": "Prefill",
        "world_size": world_size,
        "dp_size": dp_size,
        "rank_ip": "10.9.9.9",
        "rank_port": 1234,
        "engine_rank": 0,
        "cache_layout": LAYOUT,
    }
    reply = state.handle("PUT", "/route", {}, json.dumps(body).encode())
    assert (reply.status, reply.reason) == (400, "bad_field")
    assert needle in reply.body
    assert get(state, "0", "0") == before
    assert (state.world_size, state.registered_ranks) == (1, 1)


def test_sizes_within_the_bounds_are_accepted() -> None:
    assert put(BootstrapState(), 4095, world_size=MAX_WORLD_SIZE, dp_size=4) == (200, "OK")
    assert put(BootstrapState(), 1023, world_size=1024, dp_size=1) == (200, "OK")


def test_a_huge_engine_rank_is_refused_with_a_short_message() -> None:
    status, body = put(BootstrapState(), 10**4000)
    assert status == 400
    assert "outside [0, 2)" in body
    assert len(body) < 200


def test_a_long_role_is_refused() -> None:
    status, body = put(BootstrapState(), 0, role="x" * 65)
    assert status == 400
    assert "role is longer than 64" in body


def test_the_table_never_outgrows_the_world_size() -> None:
    state = BootstrapState()
    for i in range(200):
        put(state, i % 8, world_size=8, dp_size=2)
        put(state, i, world_size=8 * (i + 2), dp_size=1)  # refused: other sizes
        put(state, -i - 1, world_size=8, dp_size=2)  # refused: no such rank
    assert state.registered_ranks == 8
    assert sum(len(ranks) for ranks in state._table.values()) == 8


@given(
    st.dictionaries(
        st.sampled_from(
            ["role", "world_size", "dp_size", "rank_ip", "rank_port", "engine_rank", "cache_layout"]
        ),
        st.one_of(
            st.none(),
            st.integers(-(2**80), 2**80),
            st.sampled_from(["*", "Prefill", "foo bar", "127.0.0.1", "::1", LAYOUT]),
        ),
    ),
)
def test_any_put_leaves_a_table_bounded_by_a_valid_world_size(body: dict[str, Any]) -> None:
    state = BootstrapState()
    reply = state.handle("PUT", "/route", {}, json.dumps(body).encode())
    assert reply.status in (200, 400)
    if reply.status == 200:
        assert state.world_size is not None
        assert 0 < state.world_size <= MAX_WORLD_SIZE
        assert state.registered_ranks <= state.world_size
        for ranks in state._table.values():
            for entry in ranks.values():
                assert is_valid_host(entry.rank_ip)
                assert 0 < entry.rank_port < 65536
    else:
        assert state.world_size is None
        assert state.registered_ranks == 0


def test_refusals_name_their_reason() -> None:
    state = BootstrapState()
    assert state.handle("GET", "/nope", {}, b"").reason == "not_found"
    assert state.handle("DELETE", "/route", {}, b"").reason == "method_not_allowed"
    assert state.handle("POST", "/health", {}, b"").reason == "method_not_allowed"
    assert state.handle("GET", "/route", {}, b"").reason == "bad_query"
    assert state.handle("PUT", "/route", {}, b"[").reason == "bad_body"
    assert put(state, 0, layout="{}")[0] == 400
    put(state, 0, world_size=1)
    assert get(state, "5", "0")[0] == 404
    assert state.get_route({"engine_rank": "5", "target_dp_group": "0"}).reason == "unknown_rank"
    other = contract_json(("layer.0.k", "layer.0.v"))
    reply = state.handle(
        "PUT",
        "/route",
        {},
        json.dumps(
            {
                "role": "Prefill",
                "world_size": 1,
                "dp_size": 1,
                "rank_ip": "h",
                "rank_port": 1,
                "engine_rank": 0,
                "cache_layout": other,
            }
        ).encode(),
    )
    assert (reply.status, reply.reason) == (409, "conflict")
    assert state.handle("GET", "/x" * 1000, {}, b"").body.count("/x") < 40


# -- the client half: what a server that checks nothing may return ------------------


@pytest.mark.parametrize("host", ["*", "foo bar", "", "1.2.3", "x" * 300, "tcp://h"])
def test_a_fetched_rank_with_an_unusable_address_is_a_wire_error(host: str) -> None:
    with pytest.raises(WireError, match="no usable endpoint") as err:
        parse_rank_info(json.dumps({"rank_ip": host, "rank_port": 5000}))
    assert len(str(err.value)) < 400


@pytest.mark.parametrize(
    "info",
    [
        {"prefill_tp_size": 2**62, "prefill_dp_size": 1},
        {"prefill_tp_size": 4, "prefill_dp_size": 8},
        {"prefill_tp_size": 2048, "prefill_dp_size": 1},
        {"prefill_tp_size": 4, "prefill_dp_size": 1, "prefill_pp_size": 8},
        {"prefill_tp_size": 4, "prefill_dp_size": 1, "prefill_pp_size": 2**40},
        {"prefill_tp_size": 2, "prefill_dp_size": 1, "cache_layout": ""},
        {"prefill_tp_size": 2, "prefill_dp_size": 1, "cache_layout": "x" * (257 << 10)},
        {"prefill_tp_size": 1, "prefill_dp_size": 1, "cache_fields_by_stage": [["a"], ["b"]]},
    ],
)
def test_fetched_parallel_info_with_unusable_sizes_is_a_wire_error(info: dict[str, Any]) -> None:
    body = {"cache_layout": "x", **info}
    with pytest.raises(WireError):
        parse_parallel_info(json.dumps(body))
