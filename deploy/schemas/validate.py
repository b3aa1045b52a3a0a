#!/usr/bin/env python3
"""Validates Kubernetes manifests offline and fails on any warning.

Built-in kinds are checked with kubernetes-validate (strict: unknown fields are
errors) against every Kubernetes version named by --kubernetes-version. Other
kinds are checked against the JSON Schema in this folder named
<kind lowercased>.<apiVersion with / as ->.json (Draft 2020-12), or, for
lockmesh's own kinds, against the openAPIV3Schema of their CustomResourceDefinition
in deploy/crds/ (the schema the API server admits them with). A kind that has
neither schema is an error, never a warning: nothing passes unchecked.

Usage: validate.py [--kubernetes-version V]... FILE...
Exit 0 when every document of every file is valid, 1 otherwise; one line per
document (OK/ERROR) on stdout. Run it with the venv scripts/setup installs:
.tools/k8s-validate/bin/python deploy/schemas/validate.py FILE...
"""
import argparse
import json
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

HERE = pathlib.Path(__file__).resolve().parent


class Loader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1 timestamps: like kubectl (sigs.k8s.io/yaml),
    an unquoted 2026-05-04T09:12:31Z stays a string."""


Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:timestamp"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


CRDS = HERE.parent / "crds"


def crd_schema(api_version, kind):
    """The openAPIV3Schema a CRD in deploy/crds/ serves for (api_version, kind)."""
    group, _, version = api_version.rpartition("/")
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=Loader):
            if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd.get("spec") or {}
            if spec.get("group") != group or (spec.get("names") or {}).get("kind") != kind:
                continue
            for v in spec.get("versions") or []:
                if v.get("name") == version and v.get("served"):
                    return (v.get("schema") or {}).get("openAPIV3Schema"), path
    return None, None


def strict(schema):
    """A CRD schema as the API server's strict field validation applies it: an
    object with declared properties admits no other field (unless it preserves
    unknown fields), where plain JSON Schema would let them through."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def with_object_meta(schema):
    """The top level also carries apiVersion, kind and metadata, which a CRD's
    schema leaves implicit."""
    schema = dict(schema)
    props = dict(schema.get("properties") or {})
    for field in ("apiVersion", "kind"):
        props.setdefault(field, {"type": "string"})
    props.setdefault("metadata", {"type": "object"})
    schema["properties"] = props
    return schema


def custom_schema(api_version, kind):
    path = HERE / ("%s.%s.json" % (kind.lower(), api_version.replace("/", "-")))
    if not path.is_file():
        schema, crd = crd_schema(api_version, kind)
        return (strict(with_object_meta(schema)), crd) if schema is not None else (None, path)
    return json.loads(path.read_text()), path


def check(doc, versions):
    """Returns a list of problems of one document (empty when valid)."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return ["not a Kubernetes object (apiVersion and kind required)"]
    api_version, kind = doc["apiVersion"], doc["kind"]
    schema, path = custom_schema(api_version, kind)
    if schema is not None:
        validator = jsonschema.Draft202012Validator(schema)
        jsonschema.Draft202012Validator.check_schema(schema)
        return ["%s: %s (schema %s)" % ("/".join(map(str, e.absolute_path)) or "<root>", e.message, path.name)
                for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
    problems = []
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            return ["no schema for %s %s: not a built-in kind of Kubernetes %s and no %s" % (api_version, kind, version, path.name)]
        except kubernetes_validate.ValidationError as e:
            where = "/".join(map(str, e.path)) or "<root>"
            problems.append("Kubernetes %s: %s: %s" % (version, where, e.message))
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubernetes-version", action="append", dest="versions")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    versions = args.versions or ["1.30.0", "1.37.0"]
    failed = 0
    for name in args.files:
        try:
            docs = [d for d in yaml.load_all(pathlib.Path(name).read_text(), Loader=Loader) if d is not None]
        except (OSError, yaml.YAMLError) as e:
            print("ERROR %s: cannot read: %s" % (name, e))
            failed += 1
            continue
        if not docs:
            print("ERROR %s: no documents" % name)
            failed += 1
        for i, doc in enumerate(docs, 1):
            what = "%s#%d %s/%s" % (name, i, doc.get("kind", "?") if isinstance(doc, dict) else "?",
                                     (doc.get("metadata") or {}).get("name", "?") if isinstance(doc, dict) else "?")
            problems = check(doc, versions)
            if problems:
                failed += 1
                for p in problems:
                    print("ERROR %s: %s" % (what, p))
            else:
                print("OK %s" % what)
    print("%d document(s) failed" % failed if failed else "all documents valid")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
