"""Re-vendor the CRD schemas under hp/core/schedulers/k8s/crds/ from upstream CRD YAML files (run by hand).

    python packages/hp-core/scripts/vendor_k8s_crds.py KIND=VERSION=FILE.yaml ...

For each CRD file: the ``openAPIV3Schema`` of the named version, with every schema's ``description``
removed (documentation only; validation is unchanged), written as compact JSON to
``crds/<group>_<plural>_<version>.json``. Record the upstream tag and commit in crds/NOTICE.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "src" / "hp" / "core" / "schedulers" / "k8s" / "crds"
SUBSCHEMAS = ("items", "additionalProperties", "not")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")


def strip(schema: object) -> object:
    """``schema`` without ``description`` keywords (a property *named* description is kept)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k != "description"}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: strip(sub) for name, sub in out["properties"].items()}
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = strip(out[key])
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strip(sub) for sub in out[key]]
    return out


def main(argv: list[str]) -> int:
    for arg in argv:
        kind, version, path = arg.split("=", 2)
        crd = yaml.safe_load(Path(path).read_text())
        spec = crd["spec"]
        assert spec["names"]["kind"] == kind, (kind, spec["names"]["kind"])
        (served,) = [v for v in spec["versions"] if v["name"] == version]
        schema = strip(served["schema"]["openAPIV3Schema"])
        out = OUT / f"{spec['group']}_{spec['names']['plural']}_{version}.json"
        doc = {"group": spec["group"], "version": version, "kind": kind, "plural": spec["names"]["plural"],
               "openAPIV3Schema": schema}
        out.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
        print(f"{out.name}: {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
