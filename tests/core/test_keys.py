"""Chained page keys: equal keys exactly when the whole prefix, model and salt agree."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.config import PageLayout
from kvray.core.errors import RequestError
from kvray.core.keys import ModelFingerprint, _from_list_array, _tokens, pack_keys, page_keys, unpack_keys
from tests.properties import examples

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=4, page_tokens=4, dtype="float32")
FP = ModelFingerprint.of(LAYOUT, "tiny")
tokens = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)


@settings(max_examples=examples(200), deadline=None)
@given(a=tokens, b=tokens)
def test_key_i_equal_iff_first_pages_equal(a, b):
    ka, kb = page_keys(a, FP), page_keys(b, FP)
    assert len(ka) == len(a) // 4 and len(kb) == len(b) // 4
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (a[: 4 * (i + 1)] == b[: 4 * (i + 1)])


@given(a=tokens)
def test_salt_and_model_separate_keys(a):
    if len(a) < 4:
        return
    other_model = ModelFingerprint.of(LAYOUT.model_copy(update={"dtype": "float16"}), "tiny")
    base = page_keys(a, FP)
    assert set(base).isdisjoint(page_keys(a, FP, salt="tenant-b"))
    assert set(base).isdisjoint(page_keys(a, other_model))
    assert page_keys(a, FP, salt="same") == page_keys(np.asarray(a), FP, salt="same")


def test_partial_last_page_has_no_key():
    assert page_keys(list(range(3)), FP) == []
    assert len(page_keys(list(range(11)), FP)) == 2


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "empty request"),
        ([[1, 2], [3, 4]], "flat sequence"),
        ([1.5, 2.0], "integers"),
        ([-1, 2], r"\[0, 2\*\*31\)"),
        ([2**31], r"\[0, 2\*\*31\)"),
    ],
)
def test_bad_token_ids_are_rejected(bad, message):
    with pytest.raises(RequestError, match=message):
        page_keys(bad, FP)


def test_over_long_request_is_rejected():
    with pytest.raises(RequestError, match="exceeds max_request_tokens=8"):
        page_keys(list(range(9)), FP, max_tokens=8)


def test_packed_keys_round_trip_and_a_torn_buffer_is_refused():
    keys = [0, 1, (1 << 128) - 1, 12345 << 70]
    assert unpack_keys(pack_keys(keys)) == keys and unpack_keys(b"") == []
    with pytest.raises(RequestError, match="multiple of 16"):
        unpack_keys(pack_keys(keys)[:-1])


@settings(max_examples=examples(200), deadline=None)
@given(
    a=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=70),
    page=st.sampled_from([1, 3, 4, 16]),
    kind=st.sampled_from(["list", "tuple", "int32", "int64", "uint32"]),
)
def test_keys_of_a_list_equal_those_of_an_array(a, page, kind):
    """Lists take a faster conversion than arrays; the keys must be the same bits."""
    fp = ModelFingerprint(digest=FP.digest, page_tokens=page)
    given_as = {"list": a, "tuple": tuple(a)}.get(kind)
    if given_as is None:
        given_as = np.asarray(a, dtype=kind)
    assert page_keys(given_as, fp, salt="s") == page_keys(np.asarray(a, dtype=np.int32), fp, salt="s")


def test_the_token_extension_is_built():
    """kvray converts lists in C (kvray/core/_tokens.c); a checkout run through PYTHONPATH
    must build it, or lookups from lists run at half speed: fail, saying how."""
    assert _tokens is not None, "kvray.core._tokens is not built: make install, or python setup.py build_ext --inplace"


@settings(max_examples=examples(300), deadline=None)
@given(
    a=st.lists(
        st.one_of(
            st.integers(0, 2**31 - 1),
            st.sampled_from([-1, 2**31, 2**32, 2**63, -(2**70), True, 1.0, "7", None]),
        ),
        max_size=40,
    ),
    kind=st.sampled_from([list, tuple]),
)
def test_the_c_and_python_list_conversions_agree(a, kind):
    """Same int32 bits for every valid list, and None (the general path explains) for the
    rest: empty, not an int, or outside [0, 2**31)."""
    valid = bool(a) and all(isinstance(t, int) and 0 <= t < 2**31 for t in a)
    fast, fallback = _tokens.pack(kind(a)), _from_list_array(kind(a))
    if not valid:
        assert fast is None and fallback is None
        return
    want = np.asarray([int(t) for t in a], dtype="<i4")
    assert np.array_equal(np.frombuffer(fast, "<i4"), want) and np.array_equal(fallback, want)
