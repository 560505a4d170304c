"""Hostile input where settings enter kvray: the vLLM connector's ``kv_connector_extra_config``
and block codec, and the runtime's scenario files and ``kvray run`` options. Whatever comes
in, the outcome is a valid object or a :class:`~kvray.core.errors.KvrayError`; never another
exception. Each test prints how many cases it tried (``FUZZ name cases``, run with ``-s``).
"""

from __future__ import annotations

import string
from collections import Counter

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvray.apps.replay import ReplaySettings, settings_from
from kvray.cluster.config import RuntimeConfig
from kvray.core.config import PageLayout, StoreConfig
from kvray.core.errors import KvrayError
from kvray.core.pages import torch_dtype
from kvray.engines.vllm.codec import BlockCodec
from kvray.engines.vllm.settings import ConnectorSettings, connector_settings, store_config
from tests.properties import examples

pytestmark = pytest.mark.fault

CASES = 300
tried: Counter = Counter()
FUZZ = settings(max_examples=examples(CASES), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=30),
    st.sampled_from(["lru", "lfu", "arc", "rl", "rl:/nonexistent.zip", "../../etc", "", "0"]),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6
)


def mapping(fields: list[str]):
    """Dicts whose keys are mostly the real field names (so validation goes deep), some not."""
    return st.dictionaries(st.sampled_from(fields) | st.text(max_size=10), values, max_size=len(fields) + 1)


@pytest.fixture(scope="module", autouse=True)
def report_cases():
    yield
    for name, n in sorted(tried.items()):
        print(f"FUZZ {name} {n}")


LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=4, page_tokens=4, dtype="float32")


@FUZZ
@given(extra=st.one_of(values, mapping(list(ConnectorSettings.model_fields))))
def test_connector_settings_give_a_store_config_or_a_config_error(extra, tmp_path_factory):
    tried["connector_settings"] += 1
    try:
        config = store_config(connector_settings(extra), LAYOUT, served_model_name="served")
    except KvrayError:
        return
    assert isinstance(config, StoreConfig) and config.layout == LAYOUT


def layer_tensors():
    dims = st.integers(1, 6)
    dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8])
    shape = st.lists(dims, min_size=1, max_size=5)
    return st.lists(st.tuples(shape, dtypes), min_size=1, max_size=3)


@FUZZ
@given(
    backend=st.sampled_from(["CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", ""]),
    layers=st.one_of(layer_tensors(), st.integers(1, 3).map(lambda n: [((5, 2, 4, 8), torch.float32)] * n)),
    data=st.data(),
)
def test_block_codec_refuses_mismatched_caches_and_round_trips_matching_ones(backend, layers, data):
    """vLLM hands the connector its caches; one that does not fit the layout is a ConfigError,
    one that fits carries pages both ways bit-exact."""
    tried["block_codec"] += 1
    caches = [torch.zeros(shape, dtype=dtype) for shape, dtype in layers]
    layout = PageLayout(layers=len(caches), kv_heads=2, head_dim=4, page_tokens=4, dtype="float32")
    try:
        codec = BlockCodec(backend, caches, layout)
    except KvrayError:
        return
    blocks = data.draw(st.lists(st.integers(0, caches[0].shape[0] - 1), min_size=1, max_size=5, unique=True))
    pages = torch.randn(
        len(blocks), layout.layers, 2, layout.page_tokens, layout.kv_heads, layout.head_dim, dtype=torch_dtype(layout)
    )
    codec.write(blocks, pages)
    assert torch.equal(codec.read(blocks), pages)


RUNTIME_FIELDS = list(RuntimeConfig.model_fields)
REPLAY_FIELDS = list(ReplaySettings.model_fields)


@FUZZ
@given(
    document=st.one_of(
        mapping(REPLAY_FIELDS).map(yaml.safe_dump),
        st.fixed_dictionaries({"runtime": mapping(RUNTIME_FIELDS)}, optional={"nodes": values}).map(yaml.safe_dump),
        st.text(alphabet=string.printable, max_size=80),
        st.binary(max_size=40),
    )
)
def test_scenario_files_give_settings_or_a_config_error(document, tmp_path_factory):
    tried["scenario_file"] += 1
    path = tmp_path_factory.mktemp("scenario") / "scenario.yaml"
    path.write_bytes(document if isinstance(document, bytes) else document.encode())
    try:
        result = settings_from(path, {}, {}, {})
    except KvrayError:
        return
    assert isinstance(result, ReplaySettings)


@FUZZ
@given(runtime=mapping(RUNTIME_FIELDS), tiers=mapping(["device", "host", "disk"]), replay=mapping(REPLAY_FIELDS))
def test_run_options_give_settings_or_a_config_error(runtime, tiers, replay):
    """``kvray run`` options laid over the defaults (None leaves a default)."""
    tried["run_options"] += 1
    try:
        result = settings_from(None, runtime, tiers, replay)
    except KvrayError:
        return
    assert isinstance(result, ReplaySettings)


def test_found_by_fuzzing_no_tier_and_binary_scenarios_are_config_errors(tmp_path):
    """Cases the fuzzers above found: all tiers 0 escaped as a pydantic error, a non-UTF-8
    scenario file as UnicodeDecodeError, a ``tiers`` runtime option as AttributeError."""
    with pytest.raises(KvrayError, match="tiers"):
        store_config(connector_settings({"host_pages": 0}), LAYOUT, served_model_name="served")
    with pytest.raises(KvrayError, match="mapping"):
        connector_settings(["host_pages"])
    scenario = tmp_path / "scenario.yaml"
    scenario.write_bytes(b"\x80")
    with pytest.raises(KvrayError, match="UTF-8"):
        settings_from(scenario, {}, {}, {})
    with pytest.raises(KvrayError, match="tiers"):
        settings_from(None, {"tiers": []}, {}, {})
