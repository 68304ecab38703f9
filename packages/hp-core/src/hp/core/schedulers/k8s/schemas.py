"""The vendored CRD schemas (``crds/``), and validation of custom objects against them the API server's way.

Each ``crds/*.json`` holds one CRD version's ``openAPIV3Schema`` (upstream repositories, tags and licenses in
``crds/NOTICE.md``). :func:`validate` checks an object against it as an API server with
``fieldValidation=Strict`` (``kubectl``'s default) would: structural-schema extensions are turned into JSON
Schema (``nullable``, ``x-kubernetes-int-or-string``) and an unknown field is an error unless the schema
preserves unknown fields. Not checked: CEL rules (``x-kubernetes-validations``), ``format`` and the
admission webhooks of JobSet, Kueue and Volcano. Needs ``jsonschema`` (hp-core's ``test`` extra).
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from importlib import resources
from typing import Any

CRDS = {  # (apiVersion, kind) -> the file under crds/
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.x-k8s.io_jobsets_v1alpha2.json",
    ("batch.volcano.sh/v1alpha1", "Job"): "batch.volcano.sh_jobs_v1alpha1.json",
    ("kueue.x-k8s.io/v1beta2", "Workload"): "kueue.x-k8s.io_workloads_v1beta2.json",
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"): "kueue.x-k8s.io_localqueues_v1beta2.json",
}


class SchemaError(ValueError):
    """An object that its schema refuses; the message names the first offending path."""


@lru_cache(maxsize=None)
def crd(api_version: str, kind: str) -> dict[str, Any]:
    """The vendored document: ``group``, ``version``, ``kind``, ``plural`` and ``openAPIV3Schema``."""
    try:
        name = CRDS[(api_version, kind)]
    except KeyError:
        raise SchemaError(f"no vendored schema for {api_version} {kind}") from None
    return json.loads(resources.files("hp.core.schedulers.k8s").joinpath("crds", name).read_text(encoding="utf-8"))


def strict(schema: Any) -> Any:
    """``schema`` as JSON Schema with the API server's strict field validation (a copy)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in ("items", "additionalProperties", "not") else v for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [strict(sub) for sub in out[key]]
    if out.pop("x-kubernetes-int-or-string", False):
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if out.get("type") == "object" and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields") and not out.get("x-kubernetes-embedded-resource"):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


@lru_cache(maxsize=None)
def _validator(api_version: str, kind: str):  # noqa: ANN202  (a jsonschema validator)
    import jsonschema

    schema = strict(copy.deepcopy(crd(api_version, kind)["openAPIV3Schema"]))
    # metadata is ObjectMeta, which CRDs leave open: the name and labels are checked by the caller.
    schema.setdefault("properties", {})["metadata"] = {"type": "object"}
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata"})
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict[str, Any]) -> None:
    """Raise :class:`SchemaError` if ``obj`` (a custom object as sent to the API) does not validate."""
    if not isinstance(obj, dict):
        raise SchemaError(f"a custom object must be a JSON object, got {type(obj).__name__}")
    validator = _validator(str(obj.get("apiVersion")), str(obj.get("kind")))
    error = next(iter(sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))), None)
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise SchemaError(f"{obj.get('kind')} {obj.get('metadata', {}).get('name', '?')}: {where}: {error.message[:300]}")


def known(api_version: str, kind: str) -> bool:
    return (api_version, kind) in CRDS
