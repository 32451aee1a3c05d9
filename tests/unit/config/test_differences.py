from megarl.config.differences import ABSENT, differences


def test_nested_keys_are_dotted_and_a_missing_side_is_absent():
    old = {"a": 1, "b": {"c": 2, "d": {"e": 3}}, "gone": 0, "same": {"x": 1}}
    new = {"a": 1, "b": {"c": 5, "d": {"e": 3, "f": 4}}, "same": {"x": 1}, "added": [1]}
    assert differences(old, new) == {"b.c": (2, 5), "b.d.f": (ABSENT, 4), "gone": (0, ABSENT), "added": (ABSENT, [1])}
    assert repr(ABSENT) == "absent"


def test_whole_keys_are_compared_as_one_value_and_a_dict_against_a_value_is_one_difference():
    old = {"model": {"weights": 1, "files": {"config.json": "x"}}, "agent": None}
    new = {"model": {"weights": 2, "files": {"config.json": "x"}}, "agent": {"tools": "t"}}
    assert differences(old, new, whole={"model"}) == {"model": (old["model"], new["model"]), "agent": (None, {"tools": "t"})}
    assert differences(old, new) == {"model.weights": (1, 2), "agent": (None, {"tools": "t"})}
