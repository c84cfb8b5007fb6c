"""The profile: what the probe measured about one model, as frozen data (``data``), read and
written through one strict YAML path with the rules a probe's output keeps (``read``), as
per-layer arrays for the solver's hot loops (``arrays``), and evaluated at another sequence
length (``seqlen``). No torch."""

from memplan.model.reference import ModelRef
from memplan.profile.data import (
    PROFILE_SCHEMA_VERSION,
    Active,
    Affine,
    Device,
    Environment,
    FixedPart,
    Float8,
    Float8Recipe,
    Layer,
    MixedPrecision,
    Phase,
    Point,
    Precision,
    Profile,
    Segment,
    SeqGrid,
    SharedInput,
    Totals,
    affine_scale,
    affine_sub,
    affine_sum,
    is_finite_affine,
    point_at,
)
from memplan.profile.read import load_profile, profile_from_data, profile_problem, profile_to_yaml

__all__ = [
    "PROFILE_SCHEMA_VERSION",
    "Active",
    "Affine",
    "Device",
    "Environment",
    "FixedPart",
    "Float8",
    "Float8Recipe",
    "Layer",
    "MixedPrecision",
    "ModelRef",
    "Phase",
    "Point",
    "Precision",
    "Profile",
    "Segment",
    "SeqGrid",
    "SharedInput",
    "Totals",
    "affine_scale",
    "affine_sub",
    "affine_sum",
    "is_finite_affine",
    "load_profile",
    "point_at",
    "profile_from_data",
    "profile_problem",
    "profile_to_yaml",
]
