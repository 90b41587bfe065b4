"""experiments/host_adam_model.py --write-profiles: the bundled profiles' CPU Adam lines from the host
model."""

from __future__ import annotations

import sys
from pathlib import Path

from tierflow.hwprofiles import list_profiles, load_profile, profile_from_dict
from tierflow.planner.core import hostadam

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import host_adam_model  # noqa: E402

LINES = """cpu:
  memory_gbps: 204.8  # derived: 8 channels
  adam_gparams_per_s: 3.2  # assumption: 0.5 x 204.8 / 32 = 3.2
  deepspeed_adam_gparams_per_s: 1.417  # fitted on the given sweep's step
"""


def test_a_rule_line_is_rewritten_a_fitted_one_kept_and_the_rewrite_is_stable():
    fields = {"adam_gparams_per_s": (4.52, "host model (x)"),
              "deepspeed_adam_gparams_per_s": (5.49, "host model (y)")}
    out = host_adam_model.rewrite_profile_text(LINES, fields)
    assert "  adam_gparams_per_s: 4.52  # host model (x)\n" in out
    assert "  deepspeed_adam_gparams_per_s: 1.417  # fitted on the given sweep's step\n" in out
    assert "  memory_gbps: 204.8  # derived: 8 channels\n" in out
    assert host_adam_model.rewrite_profile_text(out, fields) == out


def test_the_bundled_profiles_are_what_the_script_writes(tmp_path):
    """Running --write-profiles on a copy of the bundled profiles changes nothing: they are regenerated."""
    for name in list_profiles():
        (tmp_path / f"{name}.yaml").write_text((ROOT / "hwprofiles" / f"{name}.yaml").read_text())
    assert host_adam_model.write_profiles(tmp_path) == []
    # and a profile carrying the old rule is rewritten to the model's rate, which then loads
    path = tmp_path / "rtx4090-lohan.yaml"
    old = path.read_text()
    key = "  adam_gparams_per_s: "
    start = old.index(key)
    end = old.index("\n", start)
    path.write_text(old[:start] + key + "6.4  # assumption: 0.5 x 409.6 / 32 = 6.4" + old[end:])
    assert host_adam_model.write_profiles(tmp_path) == ["rtx4090-lohan.yaml"]
    import yaml

    hw = profile_from_dict(yaml.safe_load(path.read_text()))
    want = hostadam.profile_fields(load_profile("rtx4090-lohan"))["adam_gparams_per_s"][0]
    assert hw.cpu.adam_gparams_per_s == want
