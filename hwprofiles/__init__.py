"""Hardware profiles for tierflow: GPU, PCIe, CPU memory, NVMe SSDs and prices of one training box.

    >>> from tierflow.hwprofiles import load_profile
    >>> p = load_profile("rtx4090-lohan").with_overrides({"ssd.count": 6})
    >>> p.name
    'rtx4090-lohan[ssd.count=6]'

Bundled profiles are the ``*.yaml`` files in this package; ``list_profiles()`` names them. ``load_hw(name,
["ssd.count=6"])`` loads one with ``section.key=value`` overrides (the parser of them: overrides.py).
"""

from .overrides import OverrideError, load_hw, parse_overrides
from .profile import (
    P2P_CHOICES,
    SCHEMA_VERSION,
    CpuSpec,
    GpuSpec,
    HardwareProfile,
    NetworkSpec,
    PcieSpec,
    PriceSpec,
    ProfileError,
    SsdSpec,
    TopologySpec,
    list_profiles,
    load_profile,
    nullable,
    profile_from_dict,
    save_profile,
    type_name,
)

__all__ = [
    "P2P_CHOICES",
    "NetworkSpec",
    "TopologySpec",
    "SCHEMA_VERSION",
    "CpuSpec",
    "GpuSpec",
    "HardwareProfile",
    "OverrideError",
    "PcieSpec",
    "PriceSpec",
    "ProfileError",
    "SsdSpec",
    "list_profiles",
    "load_hw",
    "load_profile",
    "nullable",
    "parse_overrides",
    "profile_from_dict",
    "save_profile",
    "type_name",
]
