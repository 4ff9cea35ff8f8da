"""The vLLM connector's cache salt → namespace mapping (issue 32 item 5): a salted
request's chunks live in ``<namespace>/salt-<hash>``, unsalted ones in the
deployment's namespace; the option is off by default. (The scheduler and worker
halves are driven against a real server in tests/e2e/vllm/test_salt.py.)"""

from __future__ import annotations

import hashlib

from kvsvc.integrations.vllm.config import SALT_HASH_CHARS, VllmConnectorConfig, salt_namespace


def test_a_salt_maps_to_a_namespace_of_its_own_under_the_deployments() -> None:
    a = salt_namespace("vllm/abc", "user-1")
    assert a == "vllm/abc/salt-" + hashlib.sha256(b"user-1").hexdigest()[:SALT_HASH_CHARS]
    assert a == salt_namespace("vllm/abc", "user-1")  # stable: every engine agrees
    assert a != salt_namespace("vllm/abc", "user-2")
    assert a != salt_namespace("vllm/other", "user-1")
    assert a.startswith("vllm/abc/")  # a tenant granted "vllm/*" is granted it
    assert "user-1" not in a  # the salt itself never reaches kvsvc


def test_no_salt_keeps_the_deployments_namespace() -> None:
    assert salt_namespace("vllm/abc", None) == "vllm/abc"
    assert salt_namespace("vllm/abc", "") == "vllm/abc"


def test_the_option_is_off_by_default_and_parsed_like_every_key() -> None:
    assert VllmConnectorConfig.parse(None, {}).salt_namespaces is False
    assert VllmConnectorConfig.parse({"salt_namespaces": True}, {}).salt_namespaces is True
    env = {"KVSVC_VLLM_SALT_NAMESPACES": "1"}
    assert VllmConnectorConfig.parse(None, env).salt_namespaces is True
