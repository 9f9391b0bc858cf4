"""PolicyConfig: presets form the ablation ladder; bad values are refused by name."""

from __future__ import annotations

import pytest

from talaria.policies.config import LEAVE_ONE_OUT, NEEDS, PRESETS, PolicyConfig, preset

MECHANISMS = ("d2d_staging", "host_kv", "session_prefill", "soft_reservations",
              "session_priority", "priority_switch", "lend_staging")


def test_presets_add_one_mechanism_at_a_time() -> None:
    ladder = ["baseline", "+staging", "+host_kv", "+sp", "+priority", "+priority_switch",
              "talaria"]
    assert list(PRESETS)[:7] == ladder
    on = [{m for m in MECHANISMS if getattr(PRESETS[name], m)} for name in ladder]
    assert on[0] == {"soft_reservations"}  # the reference's baseline keeps reservations
    for before, after in zip(on, on[1:], strict=False):
        assert before < after and len(after - before) == 1
    assert on[-1] == set(MECHANISMS)


def test_leave_one_out_presets_turn_off_one_mechanism_of_talaria() -> None:
    for name, off in LEAVE_ONE_OUT:
        on = {m for m in MECHANISMS if getattr(PRESETS[name], m)}
        assert on == set(MECHANISMS) - {off} - {m for m, need in NEEDS.items() if need == off}
    assert not PRESETS["-staging"].lend_staging  # lending needs a staging region
    assert PRESETS["-lending"].with_(name="+priority_switch") == PRESETS["+priority_switch"]


def test_kv_demotion_is_an_option_off_in_every_preset() -> None:
    """Demotion paid at no figure of the suite (docs/constants.md): no preset turns it on,
    and it is not a rung or a leave-one-out row; a research run turns it on by name."""
    assert not any(p.kv_demotion for p in PRESETS.values())
    assert "kv_demotion" not in {off for _, off in LEAVE_ONE_OUT}
    assert preset("talaria", kv_demotion=True).kv_demotion


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
