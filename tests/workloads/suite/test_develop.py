"""``make develop``: a variant of Talaria tried against it on development traces only."""

from __future__ import annotations

from typing import Any

import pytest

from talaria.cli import main
from workloads.replay.systems import SYSTEMS, SystemConfig
from workloads.suite.develop import (
    DEV_SUITE_TRACES,
    check_development,
    format_development,
    parse_variant,
    run_development,
)
from workloads.suite.leave_one_out import comparisons_from_json, leave_one_out_json
from workloads.suite.scenarios import SUITE_TRACES, TRACES, SuiteConfig, draw_sessions
from workloads.traces.readers import real_trace_path

QUANTUM_60 = {"slot_close": "quantum", "slot_quantum_s": 60.0}


def test_a_variant_sets_policy_and_system_fields_by_their_types() -> None:
    spec = ("talaria:min_slot_factor=20, session_prefill=false,session_priority=false,"
            "queue_order=las,staging_region=second")
    variant = parse_variant(spec)
    talaria = SYSTEMS["talaria"]
    assert variant.name == spec
    assert variant.policy == talaria.policy.with_(min_slot_factor=20.0, session_prefill=False,
                                                  session_priority=False, queue_order="las")
    assert variant.staging_region == "second" and talaria.staging_region == "largest"
    assert variant.host_kv == talaria.host_kv and variant.placement == talaria.placement
    # host_kv is the policy's and the engine's: both go
    without = parse_variant("talaria:host_kv=false,kv_demotion=false")
    assert not without.policy.host_kv and not without.host_kv
    # a row alone is that row, renamed
    assert parse_variant("-priority_switch").policy == SYSTEMS["-priority_switch"].policy


@pytest.mark.parametrize(("spec", "says"), [
    ("nobody:min_slot_factor=2", "no row 'nobody'"),
    ("talaria:min_slot_factr=2", "no field 'min_slot_factr'"),
    ("talaria:min_slot_factor=many", "min_slot_factor takes a float, not 'many'"),
    ("talaria:session_prefill=yes", "session_prefill takes a bool, not 'yes'"),
    ("talaria:slot_close=sideways", "slot_close must be one of"),
    ("talaria:queue_order=las", "queue_order 'las' contradicts it"),
    ("talaria:min_slot_factor", "'min_slot_factor' is not field=value"),
    ("talaria:name=other", "no field 'name'"),
    # a system the row's own checks refuse: staging policy without a staging region
    ("baseline:d2d_staging=true", "the policy stages but the engine cannot"),
])
def test_a_bad_variant_is_refused_naming_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"variant '{spec}'") as raised:
        parse_variant(spec)
    assert says in str(raised.value)


def test_development_never_touches_a_report_trace() -> None:
    assert DEV_SUITE_TRACES == ("miniswe", "claude-code-dev", "generated-3", "generated-5",
                                "generated-13")
    assert all(TRACES[t].split == "dev" for t in DEV_SUITE_TRACES)
    report = [t for t, source in SUITE_TRACES.items() if source.split == "report"]
    assert report and not set(report) & set(DEV_SUITE_TRACES)
    for trace in report:
        with pytest.raises(ValueError, match=f"{trace}: report trace"):
            check_development(("miniswe", trace))
    with pytest.raises(ValueError, match="unknown trace"):
        check_development(("generated-4",))
    # the generator's development seeds draw other sessions than its report seeds
    spec = SuiteConfig().spec
    first = {t: [s.calls[0].input_tokens for s in draw_sessions(t, 5, 0, spec, "x")]
             for t in ("generated-3", "generated-7", "generated-11")}
    assert len({tuple(v) for v in first.values()}) == 3


@pytest.mark.skipif(not real_trace_path().exists(), reason="the shared real trace is absent")
def test_the_real_traces_development_half_is_not_its_report_half() -> None:
    dev = {s.session_id for s in TRACES["claude-code-dev"].load()}
    report = {s.session_id for s in TRACES["claude-code"].load()}
    assert dev and report and not dev & report


def test_a_variant_runs_on_talarias_sessions_and_its_own_value_changes_nothing() -> None:
    config = SuiteConfig(traces=("generated-3",), loads=(1.0,), servers=(1,),
                         sessions_per_server=3, pooled_sessions=3)
    same = parse_variant("talaria:min_slot_factor=10")  # Talaria's own value
    other = parse_variant("vllm_sleep")  # another system altogether
    found = run_development(config, [same, other], QUANTUM_60)
    assert {c.scenario for c in found} == {"generated-3/burst/1srv", "generated-3/poisson-1/1srv"}
    assert len(found) == 2 * 2 * 3
    for c in found:
        if c.row == same.name:
            assert c.value == c.talaria and c.ci95 == (0.0, 0.0) and c.verdict == "neither"
    assert any(c.value != c.talaria for c in found if c.row == other.name)
    text = format_development(found, 1)
    assert "variant 1: talaria:min_slot_factor=10" in text and "variant 2: vllm_sleep" in text
    assert "generated-3/poisson-1/1srv" in text
    assert comparisons_from_json(leave_one_out_json(found, 1)) == found
    with pytest.raises(ValueError, match="claude-code: report trace"):
        run_development(SuiteConfig(traces=("claude-code",)), [same], QUANTUM_60)
    with pytest.raises(ValueError, match="names of their own"):
        run_development(config, [same, same], QUANTUM_60)
    with pytest.raises(ValueError, match="at least one variant"):
        run_development(config, [], QUANTUM_60)


def test_the_command_refuses_what_develop_cannot_take(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--develop=talaria:min_slot_factor=20", "--dev-traces=claude-code"]) == 2
    assert "claude-code: report trace" in capsys.readouterr().err
    assert main(["replay", "--develop=talaria", "--policies", "talaria"]) == 2
    assert "--develop runs the development scenarios" in capsys.readouterr().err
    assert main(["replay", "--develop=talaria", "--day", "1"]) == 2
    assert "--develop runs the development scenarios" in capsys.readouterr().err
    assert main(["replay", "--develop=talaria:nothing=1"]) == 2
    assert "no field 'nothing'" in capsys.readouterr().err
    assert main(["replay", "--dev-traces=miniswe"]) == 2
    assert "--dev-traces and --dev-draws go with --develop" in capsys.readouterr().err


def test_the_command_runs_its_variants_on_the_servers_its_flags_describe(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """What ``--develop`` hands the run: the variants parsed, the development traces asked
    for, the quick suite's sizes, the simulator flags in the cluster spec, the baseline's
    default-trace setting for the Poisson rates."""
    import workloads.suite.cli as suite_cli
    from workloads.suite.leave_one_out import Comparison

    asked: dict[str, Any] = {}

    def fake_run(config: SuiteConfig, variants: list[SystemConfig], baseline_setting: object,
                 *, draws: int, workers: int, progress: bool) -> list[Comparison]:
        asked.update(config=config, names=[v.name for v in variants],
                     baseline=baseline_setting, draws=draws)
        return [Comparison("miniswe/burst/1srv", name, f, 100.0, 103.0, (0.01, 0.05))
                for name in asked["names"] for f in ("p50", "p95", "mean")]

    monkeypatch.setattr(suite_cli, "run_development", fake_run)
    assert main(["replay", "--develop=talaria:min_slot_factor=20", "--develop=-sp",
                 "--dev-traces=miniswe,generated-5", "--dev-draws", "2", "--fused-steps", "32",
                 "--cut-fused-steps", "--no-progress"]) == 0
    config = asked["config"]
    assert isinstance(config, SuiteConfig)
    assert asked["names"] == ["talaria:min_slot_factor=20", "-sp"] and asked["draws"] == 2
    assert config.traces == ("miniswe", "generated-5") and config.loads == (0.5, 1.0)
    assert config.pooled_sessions == 60 and config.servers == (1, 4)
    assert config.spec.max_fused_decode_steps == 32 and config.spec.cut_fused_steps
    # settings tuned for other physics do not apply: the baseline's own setting, as the
    # suite's fallback does under these flags
    assert asked["baseline"] == SYSTEMS["baseline"].setting
    out = capsys.readouterr().out
    assert "variant 2: -sp" in out and "+3.0+" in out
    # at the default physics, the baseline's setting tuned on the default trace, as in the suite
    assert main(["replay", "--develop=-sp", "--dev-traces=miniswe", "--no-progress"]) == 0
    assert asked["baseline"] == {"slot_close": "quantum", "slot_quantum_s": 480.0}
    assert asked["baseline"] != SYSTEMS["baseline"].setting


def test_the_poisson_rates_come_from_the_default_traces_seed_0_tuning(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The baseline setting whose bursts define load 1.0 is the default trace's tuned one at
    seed 0 whatever ``--seed`` is (another seed draws other sessions at rates defined the same
    way); a file tuned for another seed is not it (unless the settings are fixed), and a row
    never tuned runs its own."""
    from workloads.benchmark.tuning import Tuned, save_settings, setup_key
    from workloads.replay.cluster import ClusterSpec
    from workloads.suite import cli as suite_cli
    from workloads.traces.generator import default_trace

    spec, path = ClusterSpec(), tmp_path / "tuned.json"
    tuned = Tuned({"baseline": {"setting": {"slot_close": "quantum", "slot_quantum_s": 7.0}}})
    save_settings(tuned, setup_key(default_trace(), spec, 0), path)
    found = suite_cli.default_trace_settings(spec, path)
    assert found["baseline"] == {"slot_close": "quantum", "slot_quantum_s": 7.0}
    assert found["autellix"] == SYSTEMS["autellix"].setting

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(suite_cli, "run_develop",
                        lambda args, spec, baseline: (seen.append(baseline), ("", {}))[1])
    assert main(["replay", "--develop", "talaria:min_slot_factor=20", "--seed", "1",
                 "--settings", str(path), "--no-progress"]) == 0
    assert seen == [{"slot_close": "quantum", "slot_quantum_s": 7.0}]

    save_settings(tuned, setup_key(default_trace(), spec, 1), path)
    assert suite_cli.default_trace_settings(spec, path)["baseline"] == SYSTEMS["baseline"].setting
    # --fixed-settings: whatever the file holds, as the default trace's table reads it
    fixed = suite_cli.default_trace_settings(spec, path, fixed=True)
    assert fixed["baseline"] == {"slot_close": "quantum", "slot_quantum_s": 7.0}
