"""The whole standard library is importable at run time, with no host files mounted."""

from __future__ import annotations

import pytest

import wasibox

pytestmark = pytest.mark.guest

# Each module imports, and a small use of it gives a known answer.
WORKS = {
    "json": "print(json.dumps({'a': [1, 2]}))",
    "csv": "import io; print(next(csv.reader(io.StringIO('a,b'))))",
    "decimal": "print(decimal.Decimal('1.10') + decimal.Decimal('2.20'))",
    "datetime": "print(datetime.date(2024, 2, 29) + datetime.timedelta(days=1))",
    "re": "print(re.findall(r'\\d+', 'a1b22'))",
    "collections": "print(collections.Counter('abca').most_common(1))",
    "itertools": "print(list(itertools.accumulate([1, 2, 3])))",
    "functools": "print(functools.reduce(lambda a, b: a * b, [1, 2, 3, 4]))",
    "math": "print(math.isqrt(17), math.comb(5, 2))",
    "statistics": "print(statistics.median([3, 1, 2]))",
    "random": "random.seed(1); print(random.randint(1, 100))",
    "hashlib": "print(hashlib.sha256(b'x').hexdigest()[:8], hashlib.md5(b'x').hexdigest()[:8])",
    "base64": "print(base64.b64encode(b'hi'))",
    "struct": "print(struct.pack('<I', 1))",
    "zlib": "print(len(zlib.compress(b'a' * 1000)) < 100)",
    "dataclasses": "print(dataclasses.make_dataclass('P', ['x'])(1))",
    "enum": "print(list(enum.Enum('C', 'R G')))",
    "typing": "print(typing.get_args(typing.Optional[int]))",
    "textwrap": "print(textwrap.shorten('hello world foo', 11))",
    "string": "print(string.Template('$a!').substitute(a='hi'))",
    "fractions": "print(fractions.Fraction(1, 3) + fractions.Fraction(1, 6))",
    "heapq": "print(heapq.nsmallest(2, [5, 1, 4]))",
    "bisect": "print(bisect.bisect([1, 3, 5], 4))",
    "uuid": "print(uuid.UUID(int=1))",
    "io": "print(io.BytesIO(b'abc').read(2))",
    "unicodedata": "print(unicodedata.name('é'))",
    "xml.etree.ElementTree": "print(xml.etree.ElementTree.fromstring('<a><b/></a>')[0].tag)",
    "email": "import email.message; m = email.message.EmailMessage(); m['To'] = 'x@y'; "
             "print(m['To'])",
    "html": "print(html.escape('<&>'))",
    "urllib.parse": "print(urllib.parse.urlsplit('https://h/p?q=1').query)",
    "zoneinfo": "import datetime; print(datetime.datetime(2024, 7, 1, tzinfo="
                "zoneinfo.ZoneInfo('Europe/Paris')).utcoffset())",
    "tomllib": "print(tomllib.loads('a = 1'))",
    "sqlite3": "c = sqlite3.connect(':memory:'); print(c.execute('select 6 * 7').fetchone())",
    "asyncio": "async def f():\n    return 5\nprint(asyncio.run(f()))",
}

EXPECTED = {
    "json": '{"a": [1, 2]}', "csv": "['a', 'b']", "decimal": "3.30", "datetime": "2024-03-01",
    "re": "['1', '22']", "collections": "[('a', 2)]", "itertools": "[1, 3, 6]",
    "functools": "24", "math": "4 10", "statistics": "2", "random": "18",
    "hashlib": "2d711642 9dd4e461", "base64": "b'aGk='", "struct": "b'\\x01\\x00\\x00\\x00'",
    "zlib": "True", "dataclasses": "P(x=1)", "enum": "[<C.R: 1>, <C.G: 2>]",
    "typing": "(<class 'int'>, <class 'NoneType'>)", "textwrap": "hello [...]",
    "string": "hi!", "fractions": "1/2", "heapq": "[1, 4]", "bisect": "2",
    "uuid": "00000000-0000-0000-0000-000000000001", "io": "b'ab'",
    "unicodedata": "LATIN SMALL LETTER E WITH ACUTE", "xml.etree.ElementTree": "b",
    "email": "x@y", "html": "&lt;&amp;&gt;", "urllib.parse": "q=1", "zoneinfo": "2:00:00",
    "tomllib": "{'a': 1}", "sqlite3": "(42,)", "asyncio": "5",
}


@pytest.mark.parametrize("module", sorted(WORKS))
def test_module_imports_and_works(sandbox: wasibox.Sandbox, module: str) -> None:
    r = sandbox.run(f"import {module}\n{WORKS[module]}")
    assert r.ok, r.error
    assert r.stdout == EXPECTED[module] + "\n"


@pytest.mark.parametrize("module", [
    "difflib", "pprint", "shlex", "fnmatch", "glob", "gzip", "tarfile", "zipfile", "pickle",
    "copy", "argparse", "logging", "contextlib", "operator", "graphlib", "ipaddress", "secrets",
    "calendar", "locale", "gettext", "doctest", "unittest", "xml.dom.minidom", "json.tool",
    "concurrent.futures", "http.client", "wave", "colorsys", "codecs", "encodings.idna",
])
def test_modules_not_imported_at_build_time_still_import(sandbox: wasibox.Sandbox,
                                                         module: str) -> None:
    r = sandbox.run(f"import {module}\nprint({module}.__name__)")
    assert r.ok, r.error
    assert r.stdout == module + "\n"


@pytest.mark.parametrize("module", ["ctypes", "ssl", "bz2", "lzma", "multiprocessing",
                                    "curses", "readline", "tkinter", "mmap", "fcntl"])
def test_modules_that_cannot_work_fail_cleanly(sandbox: wasibox.Sandbox, module: str) -> None:
    r = sandbox.run(f"try:\n    import {module}\nexcept ImportError as e:\n"
                    "    print(type(e).__name__, '|', e)")
    assert r.ok, r.error
    kind, _, message = r.stdout.partition(" | ")
    assert kind in {"ModuleNotFoundError", "ImportError"}
    assert module in message


def test_importlib_resources_reads_bundled_data(sandbox: wasibox.Sandbox) -> None:
    r = sandbox.run("import importlib.resources as r\n"
                    "print(r.files('tzdata.zoneinfo').joinpath('UTC').read_bytes()[:4])")
    assert r.ok and r.stdout == "b'TZif'\n"
