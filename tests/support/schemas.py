"""The JSON Schemas of docs/ (plan files and hardware profiles) as validators, for every test that checks a
file against them."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema
from referencing import Registry, Resource

DOCS = Path(__file__).resolve().parents[2] / "docs"


@cache
def schemas() -> tuple[dict, dict]:
    return (json.loads((DOCS / "plan.schema.json").read_text()),
            json.loads((DOCS / "hwprofile.schema.json").read_text()))


def plan_validator() -> jsonschema.Draft202012Validator:
    plan_schema, hw_schema = schemas()
    registry = Registry().with_resources([(hw_schema["$id"], Resource.from_contents(hw_schema)),
                                          (plan_schema["$id"], Resource.from_contents(plan_schema))])
    return jsonschema.Draft202012Validator(plan_schema, registry=registry)


def hw_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schemas()[1])
