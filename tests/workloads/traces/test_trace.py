"""Trace format: round trip, validation messages, the real-trace and CSV readers, models."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from workloads.traces.assignment import apportion, assign_models, popularity_weights
from workloads.traces.readers import (
    load_any_trace,
    read_csv_trace,
    read_real_trace,
    real_trace_path,
)
from workloads.traces.trace import (
    Call,
    Session,
    TraceError,
    dumps_trace,
    load_trace,
    loads_trace,
    save_trace,
)


def session(sid: str = "s0", model: str = "m", arrival: float = 0.0) -> Session:
    return Session(
        session_id=sid,
        model=model,
        arrival_s=arrival,
        calls=(
            Call(1000, 50, 0.02, ("Read",)),
            Call(1200, 80, 3.5, ("Bash",)),
            Call(2000, 10, None),
        ),
    )


def line(**overrides: object) -> bytes:
    data = {
        "session_id": "s0",
        "model": "m",
        "calls": [
            {"input_tokens": 100, "output_tokens": 5, "tool_gap_s": 1.0},
            {"input_tokens": 200, "output_tokens": 5, "tool_gap_s": None},
        ],
    }
    data.update(overrides)
    return orjson.dumps(data)


def test_round_trip(tmp_path: Path) -> None:
    sessions = [session("a"), session("b", "m2", arrival=12.5)]
    path = tmp_path / "t.jsonl"
    save_trace(sessions, path)
    assert load_trace(path) == sessions
    assert loads_trace(dumps_trace(sessions)) == sessions


def test_minimal_session_gets_defaults() -> None:
    (s,) = loads_trace(line())
    assert s.arrival_s == 0.0 and s.calls[0].tools == () and s.calls[1].tool_gap_s is None


@pytest.mark.parametrize(
    ("calls", "message"),
    [
        ([{"input_tokens": -3, "output_tokens": 5}], r"call 0: input_tokens must be >= 1, got -3"),
        ([{"input_tokens": 10, "output_tokens": -1}], r"call 0: output_tokens must be >= 1"),
        ([{"input_tokens": 10.5, "output_tokens": 1}], r"input_tokens must be an integer"),
        ([{"output_tokens": 5}], r"call 0: missing field\(s\) input_tokens"),
        (
            [
                {"input_tokens": 500, "output_tokens": 5, "tool_gap_s": 0.1},
                {"input_tokens": 400, "output_tokens": 5},
            ],
            r"call 1: prompt does not grow: input_tokens 400 <= previous call's 500",
        ),
        (
            [
                {"input_tokens": 500, "output_tokens": 5, "tool_gap_s": 0.1},
                {"input_tokens": 500, "output_tokens": 5},
            ],
            r"prompt does not grow",
        ),
        (
            [{"input_tokens": 5, "output_tokens": 5}, {"input_tokens": 50, "output_tokens": 5}],
            r"call 0: tool_gap_s is missing \(only the last call may omit it\)",
        ),
        (
            [{"input_tokens": 5, "output_tokens": 5, "tool_gap_s": -1}],
            r"tool_gap_s must be a finite number >= 0",
        ),
        ([], r"has no calls"),
        ([{"input_tokens": 5, "output_tokens": 5, "bogus": 1}], r"unknown field\(s\) \['bogus'\]"),
    ],
)
def test_bad_calls_get_clear_messages(calls: list, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        loads_trace(line(calls=calls), source="t.jsonl")


def test_messages_name_the_line_and_session() -> None:
    text = line() + b"\n" + line(session_id="s1", calls=[{"input_tokens": 0, "output_tokens": 1}])
    with pytest.raises(TraceError, match=r"^t\.jsonl:2: session 's1' call 0: input_tokens"):
        loads_trace(text, source="t.jsonl")


def test_bad_sessions_get_clear_messages() -> None:
    with pytest.raises(TraceError, match=r"missing field\(s\) model"):
        loads_trace(orjson.dumps({"session_id": "x", "calls": []}))
    with pytest.raises(TraceError, match="duplicate session_id 's0'"):
        loads_trace(line() + b"\n" + line())
    with pytest.raises(TraceError, match=r"t:1: not valid JSON"):
        loads_trace(b"{nope", source="t")
    with pytest.raises(TraceError, match="arrival_s must be a finite number >= 0"):
        loads_trace(line(arrival_s=-1))
    with pytest.raises(TraceError, match="holds no sessions"):
        loads_trace(b"\n")
    with pytest.raises(TraceError, match="model must be a non-empty string"):
        loads_trace(line(model=""))


@pytest.mark.skipif(not real_trace_path().exists(), reason="shared real trace not present")
def test_real_trace_reader() -> None:
    sessions = read_real_trace()
    assert len(sessions) == 179
    assert sum(s.num_calls for s in sessions) == 7713
    assert len({s.session_id for s in sessions}) == 179  # repeated attempts made unique
    assert all(s.calls[-1].tool_gap_s is None for s in sessions)
    assert any("Task" in c.tools for s in sessions for c in s.calls)
    assert loads_trace(dumps_trace(sessions)) == sessions


def test_real_trace_errors_name_the_files_own_fields(tmp_path: Path) -> None:
    """The real trace's gap is ``gap_s``: its errors say so, not our format's ``tool_gap_s``."""
    def real(gaps: list[object]) -> Path:
        calls = [{"input_tokens": 100 * (k + 1), "output_tokens": 5, "gap_s": g}
                 for k, g in enumerate(gaps)]
        path = tmp_path / "real.jsonl"
        path.write_bytes(orjson.dumps({"session_id": "s", "model": "m", "calls": calls}) + b"\n")
        return path

    with pytest.raises(TraceError, match=r"real.jsonl:1: session 's' call 0: gap_s must be a "
                       r"finite number >= 0, got -1.0"):
        load_any_trace(real([-1.0, None]))
    with pytest.raises(TraceError, match="call 0: gap_s is missing"):
        load_any_trace(real([None, None]))


def write_csv(path: Path, rows: list[str], header: str | None = None) -> Path:
    header = header or "session_id,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_csv_reader(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path / "t.csv",
        [
            "b,0,0,900,30,250",
            "a,1,1200,300,40,",  # out of order on purpose
            "a,0,0,1100,100,1500",
        ],
    )
    # session a has an empty gap on its last round; b's single round has a trailing gap
    sessions = read_csv_trace(path, model="glm-4.5-air")
    assert [s.session_id for s in sessions] == ["b", "a"]
    a = sessions[1]
    assert a.model == "glm-4.5-air"
    assert a.calls == (Call(1100, 100, 1.5), Call(1500, 40, None))
    assert sessions[0].calls == (Call(900, 30, 0.25),)


def test_csv_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"missing column\(s\) tool_wait_after_ms"):
        read_csv_trace(write_csv(tmp_path / "1.csv", [], "session_id,round_idx,prefix_len,"
                                 "input_len,output_len"))
    with pytest.raises(TraceError, match="round_idx 2 where 1 was expected"):
        read_csv_trace(write_csv(tmp_path / "2.csv", ["a,0,0,10,1,5", "a,2,11,5,1,"]))
    with pytest.raises(TraceError, match=r"3: input_len must be an integer, got 'x'"):
        read_csv_trace(write_csv(tmp_path / "3.csv", ["a,0,0,10,1,5", "a,1,11,x,1,"]))
    with pytest.raises(TraceError, match="call 0: tool_wait_after_ms is missing"):
        read_csv_trace(write_csv(tmp_path / "4.csv", ["a,0,0,10,1,", "a,1,11,5,1,"]))
    with pytest.raises(TraceError, match=r"2: tool_wait_after_ms must be a finite number >= 0, "
                       "got '-500'"):
        read_csv_trace(write_csv(tmp_path / "6.csv", ["a,0,0,10,1,-500", "a,1,11,5,1,"]))
    with pytest.raises(TraceError, match="prompt does not grow"):
        read_csv_trace(write_csv(tmp_path / "5.csv", ["a,0,0,10,1,5", "a,1,0,10,1,"]))


def test_popularity_and_apportion() -> None:
    assert popularity_weights(3, 0.0) == pytest.approx([1 / 3] * 3)
    w = popularity_weights(3, 1.0)
    assert w == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    assert apportion(30, w) == [16, 8, 6]
    assert sum(apportion(961, [5, 3, 1, 0.5])) == 961
    with pytest.raises(ValueError, match="skew"):
        popularity_weights(3, -1)


def test_assign_models_is_skewed_seeded_and_order_preserving() -> None:
    sessions = [session(f"s{i}") for i in range(30)]
    models = ["big", "mid", "small"]
    out = assign_models(sessions, models, skew=1.0, seed=3)
    assert Counter(s.model for s in out) == {"big": 16, "mid": 8, "small": 6}
    assert [s.session_id for s in out] == [s.session_id for s in sessions]
    assert out == assign_models(sessions, models, skew=1.0, seed=3)
    assert [s.model for s in out] != [s.model for s in assign_models(sessions, models, 1.0, 4)]
    uniform = assign_models(sessions, models, skew=0.0)
    assert Counter(s.model for s in uniform) == {"big": 10, "mid": 10, "small": 10}
    with pytest.raises(ValueError, match="distinct"):
        assign_models(sessions, ["a", "a"])


def test_assign_models_puts_each_session_on_a_model_whose_context_holds_it() -> None:
    """A session whose longest call (2010 tokens here) outgrows the model the shuffle gave it
    swaps with one that fits; the counts stay exact, every other session keeps its model,
    and with no model that holds it the assignment fails by name."""
    from dataclasses import replace

    sessions = [session(f"s{i}") for i in range(30)]
    models = ["big", "mid", "small"]
    plain = assign_models(sessions, models, skew=1.0, seed=3)
    long_one = next(i for i, s in enumerate(plain) if s.model == "small")
    grown = [replace(s, calls=(*s.calls, Call(5000, 100, None))) if i == long_one else s
             for i, s in enumerate(sessions)]
    contexts = {"big": 10_000, "mid": 10_000, "small": 4096}
    out = assign_models(grown, models, skew=1.0, seed=3, contexts=contexts)
    assert out[long_one].model != "small"
    assert Counter(s.model for s in out) == {"big": 16, "mid": 8, "small": 6}
    moved = [i for i, (a, b) in enumerate(zip(plain, out, strict=True)) if a.model != b.model]
    assert len(moved) == 2 and long_one in moved
    assert [s.model for s in assign_models(sessions, models, 1.0, 3, contexts)] == [
        s.model for s in plain]
    with pytest.raises(ValueError, match=f"s{long_one}.*5100 tokens"):
        assign_models(grown, models, skew=1.0, seed=3, contexts=dict.fromkeys(models, 4096))
