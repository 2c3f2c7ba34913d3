"""tests/file_order.py: the files' order for the workers, and the table it is read from."""

from types import SimpleNamespace

from tests.file_order import longest_first, seconds_from_junit


def _items(*nodeids):
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_longest_file_first_its_tests_together_and_in_order():
    items = _items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "b.py::t2")
    ordered = longest_first(items, {"a.py": 1.0, "b.py": 30.0, "c.py": 5.0})
    assert [i.nodeid for i in ordered] == ["b.py::t1", "b.py::t2", "c.py::t1", "a.py::t1", "a.py::t2"]


def test_a_file_the_table_does_not_know_goes_first():
    items = _items("old.py::t", "new.py::t", "other_new.py::t")
    ordered = longest_first(items, {"old.py": 100.0})
    assert [i.nodeid for i in ordered] == ["new.py::t", "other_new.py::t", "old.py::t"]


def test_seconds_per_file_from_junit(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a.test_x" name="t1" file="tests/a/test_x.py" time="1.5"/>'
        '<testcase classname="tests.a.test_x.TestY" name="t2" file="tests/a/test_x.py" time="2.0"/>'
        '<testcase classname="tests.test_z" name="t" time="4.0"/>'
        "</testsuite></testsuites>"
    )
    assert seconds_from_junit(report) == {"tests/test_z.py": 4.0, "tests/a/test_x.py": 3.5}
