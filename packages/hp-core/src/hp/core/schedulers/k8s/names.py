"""Checks for the strings that become Kubernetes object names, label values, quantities and images.

Everything a user passes to :mod:`hp.core.schedulers.k8s.manifest` that ends up in an object's name, a label, a
path or a resource quantity is checked here first, with the API server's own rules (apimachinery's
``IsDNS1123Label``, ``IsDNS1123Subdomain``, ``IsQualifiedName``, label values, ``resource.Quantity``),
so a bad value is one line from ``hp k8s manifest`` instead of a 422 from the cluster. Stdlib only.
"""

from __future__ import annotations

import re

from hp.core.errors import UsageError


class K8sConfigError(UsageError):
    """A Kubernetes option that does not validate: one line, exit 2."""


DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
# resource.Quantity's serialized form: a signed decimal number with an optional binary (Ki..Ei),
# decimal (n u m k M G T P E) or exponent suffix.
QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?")
BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
# A container image reference as the distribution spec spells it: [registry[:port]/]path[:tag][@digest].
IMAGE = re.compile(
    r"(?:(?:[a-zA-Z0-9-]+\.)*[a-zA-Z0-9-]+(?::\d+)?/)?"   # registry host (optional)
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"  # path
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?"   # tag, digest
)


def dns_label(value: object, what: str, max_len: int = 63) -> str:
    """An RFC 1123 label (object names of Services, Pods' generated names, namespaces, label values)."""
    if not isinstance(value, str) or len(value) > max_len or not DNS1123_LABEL.fullmatch(value):
        raise K8sConfigError(f"{what} must be a DNS-1123 label (lower-case letters, digits and '-', starting and "
                             f"ending with a letter or digit, at most {max_len} characters), got {value!r}")
    return value


def dns_subdomain(value: object, what: str) -> str:
    """An RFC 1123 subdomain (most object names: Secrets, PriorityClasses, ConfigMaps)."""
    if not isinstance(value, str) or len(value) > 253 or not DNS1123_SUBDOMAIN.fullmatch(value):
        raise K8sConfigError(f"{what} must be a DNS-1123 subdomain (lower-case letters, digits, '-' and '.', "
                             f"at most 253 characters), got {value!r}")
    return value


def label_value(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.fullmatch(value):
        raise K8sConfigError(f"{what} must be a label value (at most 63 of [A-Za-z0-9_.-], starting and ending "
                             f"alphanumeric), got {value!r}")
    return value


def secret_key(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) > 253 or not SECRET_KEY.fullmatch(value) or value in (".", ".."):
        raise K8sConfigError(f"{what} must be 1-253 of [-._a-zA-Z0-9], got {value!r}")
    return value


def quantity(value: object, what: str) -> str:
    """A resource quantity such as ``500m``, ``4``, ``32Gi``; positive."""
    if not isinstance(value, str) or not QUANTITY.fullmatch(value) or value.startswith("-") or \
            not 0 < to_number(value) < float("inf"):
        raise K8sConfigError(f"{what} must be a positive Kubernetes quantity (e.g. 4, 500m, 32Gi), got {value!r}")
    return value


def to_number(value: str) -> float:
    """The value of a quantity that :func:`quantity` accepts (bytes for memory, cores for CPU)."""
    m = re.fullmatch(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(.*)", value)
    if m is None:
        raise K8sConfigError(f"not a quantity: {value!r}")
    number, suffix = float(m.group(1)), m.group(2)
    if suffix in BINARY:
        return number * BINARY[suffix]
    if suffix in DECIMAL:
        return number * DECIMAL[suffix]
    try:
        return number * 10.0 ** int(suffix[1:])  # e/E exponent
    except OverflowError:  # 1e999: no quantity
        return float("inf")


def image(value: object, what: str = "--image") -> str:
    if not isinstance(value, str) or len(value) > 512 or not IMAGE.fullmatch(value):
        raise K8sConfigError(f"{what} must be a container image reference ([REGISTRY/]NAME[:TAG][@sha256:DIGEST]), "
                             f"got {value!r}")
    return value


def account_name(name: str) -> str:
    """The ServiceAccount (and the Role, the RoleBinding) of job ``name``."""
    return f"{name}-watch"
