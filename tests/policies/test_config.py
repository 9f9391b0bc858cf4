"""PolicyConfig: presets form the ablation ladder; bad values are refused by name."""

from __future__ import annotations

import pytest

from talaria.policies.config import LEAVE_ONE_OUT, NEEDS, PRESETS, PolicyConfig, preset

MECHANISMS = ("d2d_staging", "host_kv", "session_prefill", "soft_reservations",
              "session_priority", "priority_switch", "kv_demotion", "lend_staging")


def test_presets_add_one_mechanism_at_a_time() -> None:
    ladder = ["baseline", "+staging", "+host_kv", "+sp", "+priority", "+priority_switch",
              "+demotion", "talaria"]
    assert list(PRESETS)[:8] == ladder
    on = [{m for m in MECHANISMS if getattr(PRESETS[name], m)} for name in ladder]
    assert on[0] == {"soft_reservations"}  # the reference's baseline keeps reservations
    for before, after in zip(on, on[1:], strict=False):
        assert before < after and len(after - before) == 1
    assert on[-1] == set(MECHANISMS)


def test_leave_one_out_presets_turn_off_one_mechanism_of_talaria() -> None:
    for name, off in LEAVE_ONE_OUT:
        on = {m for m in MECHANISMS if getattr(PRESETS[name], m)}
        assert on == set(MECHANISMS) - {off} - {m for m, need in NEEDS.items() if need == off}
    assert not PRESETS["-host_kv"].kv_demotion  # demotion copies to the host KV store
    assert not PRESETS["-staging"].lend_staging  # lending needs a staging region
    assert PRESETS["-lending"].with_(name="+demotion") == PRESETS["+demotion"]
    assert PRESETS["-demotion"].lend_staging and not PRESETS["-demotion"].kv_demotion


def test_peer_mechanisms_are_checked_by_name() -> None:
    cfg = PolicyConfig(session_priority=False, priority_switch=False,
                       slot_close="drained", queue_order="las", model_order="las",
                       reservation_ttl="continuum", preempt=True)
    assert (cfg.slot_close, cfg.queue_order, cfg.preempt) == ("drained", "las", True)
    for key in ("slot_close", "queue_order", "model_order", "reservation_ttl"):
        with pytest.raises(ValueError, match=key):
            PolicyConfig(**{key: "sometimes"})


def test_overrides_and_from_dict() -> None:
    cfg = preset("talaria", host_kv=False, slot_quantum_s=5.0)
    assert not cfg.host_kv and cfg.session_prefill and cfg.slot_quantum_s == 5.0
    assert PolicyConfig.from_dict({"preset": "baseline", "sp_budget_s": 3}).sp_budget_s == 3
    assert PolicyConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slot_quantum_s": 0}, "slot_quantum_s"),
        ({"sp_budget_s": -1}, "sp_budget_s"),
        ({"max_queue_calls": 0}, "max_queue_calls"),
        ({"gap_ewma_alpha": 1.5}, "gap_ewma_alpha"),
        ({"host_kv": "yes"}, "host_kv"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**kwargs)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy preset"):
        preset("fastest")
    with pytest.raises(ValueError, match="unknown PolicyConfig field"):
        preset("talaria", router_affinity=True)
