"""``tspd wire decode`` and the committed example captures in examples/wire/."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from types import ModuleType

import pytest
from click.testing import CliRunner, Result

from tspd.cli import main
from tspd.core.kv_events import BlockRemoved, KVEventBatch, encode_batch, encode_pub_frames
from tspd.core.poll import TransferPoll
from tspd.core.wire import StatusMessage, encode_status

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "wire"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "make_wire_examples", EXAMPLES / "make_examples.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(kind: str, *args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(main, ["wire", "decode", "--kind", kind, *args], input=stdin)


def header(path: Path, key: str) -> str | None:
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}: "):
            return line.split(": ", 1)[1]
    return None


HEX_EXAMPLES = sorted(EXAMPLES.glob("*.hex"))


def test_examples_are_what_the_generator_writes() -> None:
    expected = _load_generator().examples()
    on_disk = {p.name: p.read_text() for p in EXAMPLES.iterdir() if p.suffix in (".hex", ".json")}
    assert on_disk == expected, "examples/wire is stale: run examples/wire/make_examples.py"


def test_there_are_good_and_bad_examples() -> None:
    names = {p.name for p in HEX_EXAMPLES}
    assert {"registration.hex", "preallocation.hex", "status.hex", "status-5frame.hex"} <= names
    assert {"bad-status.hex", "bad-registration.hex", "bad-preallocation.hex"} <= names


@pytest.mark.parametrize("path", HEX_EXAMPLES, ids=lambda p: p.name)
def test_every_example_decodes_as_its_header_says(path: Path) -> None:
    kind = header(path, "kind")
    assert kind is not None, f"{path.name} has no '# kind:' header"
    result = run(kind, str(path))
    expected_error = header(path, "expect-error")
    if path.name.startswith("bad-"):
        assert expected_error is not None
        assert result.exit_code == 1
        assert result.stderr == f"error: {expected_error}\n"
        assert result.stdout == ""
    else:
        assert expected_error is None
        assert result.exit_code == 0, result.output
        assert isinstance(json.loads(result.stdout), dict)


@pytest.mark.parametrize("kind", ["contract", "manifest"])
def test_json_examples_round_trip_through_their_kind(kind: str) -> None:
    payload = (EXAMPLES / f"{kind}.json").read_text()
    result = run(kind, str(EXAMPLES / f"{kind}.json"))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(payload)
    # The same payload as one hex frame.
    result = run(kind, stdin=payload.strip().encode().hex() + "\n")
    assert json.loads(result.stdout) == json.loads(payload)


def test_status_fields() -> None:
    result = run("status", str(EXAMPLES / "status.hex"))
    assert json.loads(result.stdout) == {
        "frames": 7,
        "room": 1000000,
        "status": 5,
        "status_name": "TransferPoll.Success",
        "prefill_rank": 0,
        "bootstrap_token": 621224652,
        "spec_candidate_ids": [1210209511, 701474692, 832778341],
        "cached_tokens": 32,
        "bootstrap_logprob": -0.125,
    }


def test_registration_and_preallocation_fields() -> None:
    reg = json.loads(run("registration", str(EXAMPLES / "registration.hex")).stdout)
    assert reg["session_id"] == "127.0.0.1:16001"
    assert reg["status_address"] == "tcp://127.0.0.1:17001"
    assert reg["arena_base"] == "0x00007f3a00000000"
    assert reg["contract"] == json.loads((EXAMPLES / "contract.json").read_text())
    pre = json.loads(run("preallocation", str(EXAMPLES / "preallocation.hex")).stdout)
    assert pre["room"] == 1000000
    assert pre["dummy"] is False
    assert pre["manifest"] == json.loads((EXAMPLES / "manifest.json").read_text())


def test_json_list_of_hex_frames_from_stdin() -> None:
    frames = encode_status(StatusMessage(12, TransferPoll.FAILED, 3))
    result = run("status", stdin=json.dumps([f.hex() for f in frames]))
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["room"], out["status"], out["prefill_rank"], out["frames"]) == (12, 0, 3, 7)


def test_hex_lines_with_comments_and_empty_frames() -> None:
    text = "# room, status, rank, token, no candidates\n3132\n35\n30\n# a comment\n2d31\n\n"
    out = json.loads(run("status", stdin=text).stdout)
    assert out["frames"] == 5
    assert (out["room"], out["prefill_rank"], out["bootstrap_token"]) == (12, 0, -1)
    assert out["spec_candidate_ids"] == []


def test_non_finite_logprob_prints_as_a_string() -> None:
    frames = [b"1", b"5", b"0", b"-1", b"", b"0", struct.pack("<d", float("-inf"))]
    out = json.loads(run("status", stdin="\n".join(f.hex() for f in frames) + "\n").stdout)
    assert out["bootstrap_logprob"] == "-inf"


def test_kv_batch_payload_and_pub_message() -> None:
    payload = encode_batch(KVEventBatch(1.0, (BlockRemoved((7, b"\x01\x02")),), 3))
    alone = json.loads(run("kv-batch", stdin=payload.hex() + "\n").stdout)
    assert alone["dp_rank"] == 3
    assert alone["events"][0]["type"] == "BlockRemoved"
    assert alone["events"][0]["block_hashes"] == [7, "0102"]
    frames = encode_pub_frames(b"kv", 41, payload)
    message = json.loads(run("kv-batch", stdin="\n".join(f.hex() for f in frames) + "\n").stdout)
    assert (message["topic_text"], message["seq"], message["batch"]) == ("kv", 41, alone)


@pytest.mark.parametrize(
    ("kind", "stdin", "message"),
    [
        ("status", "zz\n", "error: line 1 is not hex: 'zz'\n"),
        ("status", '["3x"]', "error: frame 0 is not hex: '3x'\n"),
        ("status", "[1, 2]", "error: a JSON input must be a list of hex strings, one per frame\n"),
        ("status", "[oops", None),
        ("manifest", "31\n32\n", "error: a manifest is one frame, got 2\n"),
        ("kv-batch", "31\n32\n", None),
        ("kv-batch", "c1\n", None),
        (
            "status",
            "31\n",
            "error: Rejecting malformed Prefill status message: expected 3..8 frames, got 1\n",
        ),
        ("registration", "", "error: CachePD slab registration requires exactly 8 frames\n"),
        ("contract", "{}", "error: invalid cache transfer contract\n"),
        ("preallocation", "31\n\n\n", "error: CachePD request requires a Decode session\n"),
    ],
)
def test_malformed_input_exits_1_with_an_error_line(
    kind: str, stdin: str, message: str | None
) -> None:
    result = run(kind, stdin=stdin)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")
    assert result.stderr.count("\n") == 1
    if message is not None:
        assert result.stderr == message


def test_unknown_kind_is_a_usage_error() -> None:
    result = run("nonsense", stdin="")
    assert result.exit_code == 2
