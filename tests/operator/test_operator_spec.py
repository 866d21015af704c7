"""The API definition: generated CRD up to date and well-formed, defaults, bounds, and the
CEL rules evaluated by a CEL interpreter against the same good/bad specs as their Python
twins (Kubernetes 1.20, the test server, predates CEL)."""
from __future__ import annotations

import copy

import celpy
import pytest
import yaml

from kvship_operator import crd
from kvship_operator import spec as s
from kvship_operator.schema import SpecError, iter_rules, parse, to_dict
from operator_helpers import REPO

GOOD = {"model": {"hub": "Qwen/Qwen3-0.6B"}}


def test_committed_crd_yaml_is_current():
    for path, text in crd.outputs(REPO).items():
        assert path.exists(), f"{path} missing: run `python -m kvship_operator.crd --write`"
        assert path.read_text() == text, f"{path} is stale: run `python -m kvship_operator.crd --write`"


def test_crd_shape():
    c = yaml.safe_load(crd.render())
    v = c["spec"]["versions"][0]
    assert c["spec"]["names"]["shortNames"] == ["llmd"]
    assert v["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    assert "status" in v["subresources"]
    cols = [col["name"] for col in v["additionalPrinterColumns"]]
    for name in ("Model", "Ready", "Replicas", "Endpoint", "Routing", "Router", "Age"):
        assert name in cols
    spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["model"]
    assert spec["properties"]["tensorParallelSize"]["minimum"] == 1
    assert spec["properties"]["replicas"]["default"] == 1
    assert spec["properties"]["engine"]["default"] == {}
    assert spec["properties"]["engine"]["properties"]["image"]["default"] == s.DEFAULT_ENGINE_IMAGE
    # every CEL rule in the tree is in the CRD
    rules = [r.cel for _, _, r in iter_rules(s.LLMDeploymentSpec)]
    assert len(rules) >= 8
    in_crd = []

    def walk(node):
        if isinstance(node, dict):
            in_crd.extend(v["rule"] for v in node.get("x-kubernetes-validations", []))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(c)
    assert sorted(in_crd) == sorted(rules)


def _structural(schema, path="schema"):
    """Checks the structural-schema rules the API server enforces."""
    assert "$ref" not in schema, path
    if "anyOf" in schema:
        assert schema.get("x-kubernetes-int-or-string"), path
    else:
        assert "type" in schema or "oneOf" in schema, path
    for k, sub in schema.get("properties", {}).items():
        _structural(sub, f"{path}.{k}")
    if "items" in schema:
        _structural(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        _structural(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    _structural(crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def test_defaults_applied():
    spec = parse(s.LLMDeploymentSpec, GOOD)
    assert spec.replicas == 1 and spec.tensor_parallel_size == 1
    assert spec.engine.image == s.DEFAULT_ENGINE_IMAGE
    assert spec.model_cache.enabled and spec.model_cache.size == "50Gi"
    assert spec.autoscaling.scale_down_stabilization_seconds == 300
    assert spec.service.port == 8000
    again = parse(s.LLMDeploymentSpec, to_dict(spec))
    assert again == spec


@pytest.mark.parametrize(
    "patch, where",
    [
        ({"tensorParallelSize": 0}, "spec.tensorParallelSize"),
        ({"replicas": -1}, "spec.replicas"),
        ({"service": {"type": "Ingress"}}, "spec.service.type"),
        ({"service": {"port": 70000}}, "spec.service.port"),
        ({"model": {"hub": "bad id with spaces"}}, "spec.model.hub"),
        ({"model": {"url": "ftp://x/y"}}, "spec.model.url"),
        ({"modelCache": {"size": "lots"}}, "spec.modelCache.size"),
        ({"engine": {"args": "--x"}}, "spec.engine.args"),
        ({"model": {}}, "spec.model"),
        ({"routing": {"mode": "istio"}}, "spec.routing.mode"),
        ({"routing": {"mode": "envoy", "replicas": 0}}, "spec.routing.replicas"),
        ({"routing": {"policy": "random"}}, "spec.routing.policy"),
        ({"autoscaling": {"idleSeconds": 5}}, "spec.autoscaling.idleSeconds"),
    ],
)
def test_bounds_refused_by_parser(patch, where):
    bad = {**copy.deepcopy(GOOD), **patch}
    with pytest.raises(SpecError) as e:
        parse(s.LLMDeploymentSpec, bad)
    assert e.value.path.startswith(where), e.value


# --- CEL rules: the CEL text (run by celpy) and the Python check must agree ---------------

CASES = [  # (spec, the message of the rule that must fail, or None)
    (GOOD, None),
    ({"model": {"hub": "a/b", "url": "https://x/m.gguf"}}, "exactly one of hub, url, pvc must be set"),
    ({"model": {"url": "https://x/m.gguf", "revision": "main"}}, "revision applies only to a hub model"),
    ({"model": {"pvc": {"claimName": "m"}, "tokenSecret": {"name": "t"}}}, "tokenSecret applies to hub and url"),
    ({**GOOD, "tensorParallelSize": 3}, "tensorParallelSize must be 1, 2, 4 or 8"),
    ({**GOOD, "tensorParallelSize": 4, "gpu": {"count": 2}}, "gpu.count must be 0 (CPU) or at least"),
    ({**GOOD, "tensorParallelSize": 2, "gpu": {"count": 0}}, "tensorParallelSize > 1 needs GPUs"),
    ({**GOOD, "tensorParallelSize": 2, "gpu": {"count": 8}}, None),
    ({**GOOD, "gpu": {"count": 0}}, None),
    ({**GOOD, "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2, "provider": "hpa"}},
     "autoscaling.minReplicas must be <= autoscaling.maxReplicas"),
    ({**GOOD, "replicas": 5, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}},
     "replicas must lie within"),
    ({**GOOD, "replicas": 2, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}, None),
    ({**GOOD, "autoscaling": {"provider": "keda"}}, "autoscaling.provider keda needs"),
    ({**GOOD, "engine": {"args": ["--max-num-seqs", "64", "--port=9000"]}}, "engine.args may not set"),
    ({**GOOD, "engine": {"args": ["--max-num-seqs", "64"]}}, None),
    ({**GOOD, "engine": {"env": [{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "x", "key": "y"}}}]}},
     "set value or valueFrom, not both"),
    ({**GOOD, "modelCache": {"existingClaim": "c", "storageClassName": "fast"}}, "storageClassName applies only"),
    ({**GOOD, "modelCache": {"existingClaim": "c"}}, None),
    # scale from zero (issue 51): a router must hold the requests, and an HPA cannot reach zero
    ({**GOOD, "replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}},
     "autoscaling.minReplicas 0 (scale from zero) needs routing.mode envoy or gateway"),
    ({**GOOD, "replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2},
      "routing": {"mode": "envoy"}}, None),
    ({**GOOD, "replicas": 1, "routing": {"mode": "gateway"},
      "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2, "provider": "hpa"}},
     "autoscaling.provider hpa cannot scale to zero"),
    ({**GOOD, "replicas": 0, "routing": {"mode": "gateway"}, "autoscaling": {
        "enabled": True, "minReplicas": 0, "maxReplicas": 2, "provider": "keda",
        "prometheusServerAddress": "http://prom:9090"}}, None),
    # LoRA adapters (issue 52)
    ({**GOOD, "adapters": [{"name": "sql", "source": {"hub": "o/sql"}},
                           {"name": "fr", "source": {"pvc": {"claimName": "loras", "path": "fr/v2"}}},
                           {"name": "web", "source": {"url": "https://x/loras/web"}}]}, None),
    ({**GOOD, "adapters": [{"name": "sql", "source": {"hub": "o/sql"}}, {"name": "sql", "source": {"hub": "o/b"}}]},
     "adapters: names must be unique"),
    ({**GOOD, "adapters": [{"name": "sql", "source": {"hub": "o/sql", "url": "https://x/sql"}}]},
     "exactly one of hub, url, pvc must be set"),
    ({**GOOD, "adapters": [{"name": "sql", "source": {}}]}, "exactly one of hub, url, pvc must be set"),
    ({**GOOD, "adapters": [{"name": "sql", "source": {"pvc": {"claimName": "c", "path": "a/../../etc"}}}]},
     "pvc.path may not contain '..'"),
]


def _resolve(obj, path):
    """Objects at a rule path like spec.engine.env[*] within a defaulted spec dict."""
    parts = path.split(".")[1:]
    objs = [obj]
    for p in parts:
        nxt = []
        for o in objs:
            key = p[:-3] if p.endswith("[*]") else p
            v = o.get(key) if isinstance(o, dict) else None
            if v is None:
                continue
            nxt.extend(v if p.endswith("[*]") else [v])
        objs = nxt
    return objs


def _defaulted(raw):
    """The object as the API server stores it: schema defaults applied, but no rules run."""
    from kvship_operator import schema as sch

    rules = {}
    for _, cls, _r in iter_rules(s.LLMDeploymentSpec):
        rules[cls] = cls.__dict__.get("__rules__")
    one_of = s.ModelSource.__one_of__
    try:
        for cls in rules:
            cls.__rules__ = []
        s.ModelSource.__one_of__ = ()
        return to_dict(sch.parse(s.LLMDeploymentSpec, raw))
    finally:
        for cls, r in rules.items():
            cls.__rules__ = r
        s.ModelSource.__one_of__ = one_of


_env = celpy.Environment()


def _cel(rule: str, obj) -> bool:
    prog = _env.program(_env.compile(rule))
    return bool(prog.evaluate({"self": celpy.json_to_cel(obj)}))


@pytest.mark.parametrize("raw, failing", CASES)
def test_cel_rules_and_python_twins_agree(raw, failing):
    obj = _defaulted(raw)
    cel_failures = []
    for path, _cls, rule in iter_rules(s.LLMDeploymentSpec):
        for target in _resolve(obj, path):
            if not _cel(rule.cel, target):
                cel_failures.append(rule.message)
    if failing is None:
        assert cel_failures == []
        parse(s.LLMDeploymentSpec, raw)
    else:
        assert any(failing in m for m in cel_failures), cel_failures
        with pytest.raises(SpecError) as e:
            parse(s.LLMDeploymentSpec, raw)
        assert failing in str(e.value)


def test_engine_args_checked_with_the_engines_parser():
    """Item 1 (#20): the owned-flag check was a prefix match while the engine's parser takes
    short forms and abbreviations: `-tp 4` and `--po 9000` were accepted. engine.args now
    go through the engine's own parser: owned flags in every spelling, abbreviations and
    unknown flags are refused, with the reason."""
    from kvship_operator import engine_args

    engine_args.check(["--max-num-seqs", "64", "--kv-cache-memory", "4GiB", "--no-enable-prefix-caching"])
    for args, expect in [
        (["-tp", "4"], "may not set --tensor-parallel-size/-tp: it comes from spec.tensorParallelSize"),
        (["--tensor-parallel-size=2"], "may not set --tensor-parallel-size/-tp"),
        (["--po", "9000"], "unrecognized arguments: --po (abbreviations are not accepted"),
        (["--max-num", "4"], "unrecognized arguments: --max-num"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--port", "9000"], "may not set --port"),
        (["--served-model-name", "x"], "may not set --served-model-name: it comes from spec.servedModelName"),
        (["/models/other"], "may not set a positional MODEL: it comes from spec.model"),
        (["--max-num-seqs", "lots"], "argument --max-num-seqs: invalid"),
        (["-h"], "unrecognized arguments: -h"),
    ]:
        with pytest.raises(SpecError) as e:
            engine_args.check(args)
        assert e.value.path == "spec.engine.args" and expect in str(e.value), (args, str(e.value))


def test_engine_args_parser_needs_no_torch():
    """The operator image installs kvship without its dependencies: the parser it imports
    must not pull in torch (or anything but the standard library)."""
    import subprocess
    import sys

    code = ("import sys; import kvship_operator.engine_args; "
            "heavy = [m for m in ('torch', 'numpy', 'fastapi', 'safetensors') if m in sys.modules]; "
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
