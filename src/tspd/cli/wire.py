"""``tspd wire decode``: decode a captured control message and print it as JSON.

Input (from FILE, or stdin when FILE is ``-`` or absent) is either

* frames as hex, one per line: a blank line is an empty frame and a line starting
  with ``#`` is a comment (a final newline ends the last frame, it does not add
  one), or
* a JSON list of hex strings, one per frame.

The ``contract`` and ``manifest`` kinds also take the raw JSON payload itself; they
and ``kv-batch`` expect exactly one frame. A message that does not decode prints
``error: <message>`` on stderr, ``<message>`` being the specification's text, and
exits with status 1, so the command doubles as a validator in scripts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from typing import Any, Final, TextIO

import click

from tspd.core.contract import parse_contract
from tspd.core.errors import TspdError
from tspd.core.manifest import parse_manifest
from tspd.core.wire import (
    decode_embedding_status,
    decode_preallocation,
    decode_registration,
    decode_status,
)

__all__ = ["decode", "parse_frames", "wire"]


class InputError(Exception):
    """The input is not frames in one of the accepted notations."""


def parse_frames(text: str) -> list[bytes]:
    """Frames from hex lines or from a JSON list of hex strings (see the module doc)."""
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as err:
            raise InputError(f"input looks like a JSON list but is not JSON: {err}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise InputError("a JSON input must be a list of hex strings, one per frame")
        return [_hex(item, f"frame {n}") for n, item in enumerate(items)]
    frames = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        frames.append(_hex(stripped, f"line {number}"))
    return frames


def _hex(text: str, where: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise InputError(f"{where} is not hex: {text[:40]!r}") from None


def _one_frame(text: str, kind: str, *, raw_json: bool) -> bytes:
    if raw_json and text.lstrip().startswith("{"):
        return text.strip().encode("utf-8")
    frames = parse_frames(text)
    if len(frames) != 1:
        raise InputError(f"a {kind} is one frame, got {len(frames)}")
    return frames[0]


def _json_of(payload: bytes) -> Any:
    return json.loads(payload)


def _registration(text: str, compat: bool) -> dict[str, Any]:
    reg = decode_registration(parse_frames(text), compat=compat)
    return {
        "endpoint": reg.endpoint,
        "port": reg.port,
        "session_id": reg.session_id,
        "status_address": reg.route.status_address,
        "arena_base": f"{reg.arena_base:#018x}",
        "decode_tp_size": reg.decode_tp_size,
        "decode_tp_rank": reg.decode_tp_rank,
        "contract": _json_of(reg.contract.to_json()),
    }


def _preallocation(text: str, compat: bool) -> dict[str, Any]:
    pre = decode_preallocation(parse_frames(text))
    manifest = pre.manifest()
    return {
        "room": pre.room,
        "session_id": pre.session_id,
        "dummy": pre.is_dummy,
        "manifest": None if manifest is None else _json_of(manifest.to_json()),
    }


def _status(text: str, compat: bool) -> dict[str, Any]:
    frames = parse_frames(text)
    msg = decode_status(frames)
    logprob = msg.bootstrap_logprob
    return {
        "frames": len(frames),
        "room": msg.room,
        "status": int(msg.status),
        "status_name": msg.status.label,
        "prefill_rank": msg.prefill_rank,
        "bootstrap_token": msg.bootstrap_token,
        "spec_candidate_ids": list(msg.spec_candidate_ids),
        "cached_tokens": msg.cached_tokens,
        # Non-finite values print as strings so the output stays strict JSON.
        "bootstrap_logprob": logprob if logprob is None or math.isfinite(logprob) else str(logprob),
    }


def _embedding_status(text: str, compat: bool) -> dict[str, Any]:
    msg = decode_embedding_status(parse_frames(text))
    return {
        "room": msg.room,
        "status": int(msg.status),
        "status_name": msg.status.label,
        "rank": msg.rank,
    }


def _contract(text: str, compat: bool) -> Any:
    payload = _one_frame(text, "contract", raw_json=True)
    return _json_of(parse_contract(payload, compat=compat).to_json())


def _manifest(text: str, compat: bool) -> Any:
    return _json_of(parse_manifest(_one_frame(text, "manifest", raw_json=True)).to_json())


def _plain(value: Any) -> Any:
    """A JSON-ready copy of a decoded value: dataclasses as objects tagged with their
    type, bytes as hex, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {"type": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = _plain(getattr(value, f.name))
        return out
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _kv_batch(text: str, compat: bool) -> Any:
    """One msgpack batch payload, or a whole live PUB message ``[topic, seq, payload]``."""
    # Imported here: only this kind needs the KV event codec (and msgpack).
    from tspd.core.kv_events import decode_batch, decode_pub_frames

    frames = parse_frames(text)
    if len(frames) == 1:
        return _plain(decode_batch(frames[0]))
    if len(frames) == 3:
        message = decode_pub_frames(frames)
        return {
            "topic": message.topic.hex(),
            "topic_text": message.topic.decode("utf-8", "replace"),
            "seq": message.seq,
            "batch": _plain(decode_batch(message.payload)),
        }
    raise InputError(
        f"a kv-batch is one payload frame or a [topic, seq, payload] message, "
        f"got {len(frames)} frames"
    )


_KINDS: Final[dict[str, Callable[[str, bool], Any]]] = {
    "registration": _registration,
    "preallocation": _preallocation,
    "status": _status,
    "embedding-status": _embedding_status,
    "contract": _contract,
    "manifest": _manifest,
    "kv-batch": _kv_batch,
}


@click.group()
def wire() -> None:
    """Inspect TokenSpeed control messages."""


@wire.command()
@click.option(
    "--kind", required=True, type=click.Choice(list(_KINDS)), help="What the input holds."
)
@click.option(
    "--compat",
    is_flag=True,
    help="Accept the S3 group-spec keys (replayable, shard_count) in contracts.",
)
@click.argument("source", type=click.File("r"), default="-")
def decode(kind: str, compat: bool, source: TextIO) -> None:
    """Decode one message (hex lines or a JSON list of hex frames) and print it as JSON.

    Exits 1 with ``error: <message>`` on stderr when the message is malformed.
    """
    text = source.read()
    try:
        decoded = _KINDS[kind](text, compat)
    except (TspdError, InputError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)
    click.echo(json.dumps(decoded, indent=2, allow_nan=False))
