"""Policy: ordered rules that name, per tensor, an algorithm (or `auto`) and an optional compressor;
commlib.dispatch turns the first matching rule into a plan.

    Policy([Rule("embedding.*", "omnireduce"),
            Rule("*.weight", compression="topk(ratio=0.01)", min_bytes=1 << 20),
            Rule("*", "switchml")])

or as text (COMMLIB_POLICY): ``embedding.*=omnireduce;*.weight[min=1MiB]=topk(ratio=0.01);*=switchml``.
A rule matches a name by glob (``re:`` prefix for a regular expression), optionally by size and
dtype. The first matching rule wins; ``auto`` keeps the dispatcher's order (commlib.backends.carriers:
block-sparse by measurement -> omnireduce, dense -> switchml, else ring).

A rule may also ask for the measured block density, ``*[density<0.05]=omnireduce;*=ring`` (or
``Rule("*", "omnireduce", max_density=0.05)``): each rank measures its own tensor, so such a rule
cannot be settled alone; the controller settles it from the densest rank, and otherwise the next
matching rule applies (which must not compress).
"""
import fnmatch
import re
from dataclasses import dataclass
from typing import NamedTuple

from commlib.errors import ConfigError



def algorithms():
    """'auto' and every registered algorithm."""
    from commlib.backends import registry
    return ("auto",) + tuple(sorted(registry()))
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_bytes(text):
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ConfigError(f"{text!r} is not a size; write e.g. 4096, 64KiB or 1MB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


@dataclass(frozen=True)
class Rule:
    pattern: str = "*"
    algorithm: str = "auto"
    compression: object = None       # a compressor spec: "topk(ratio=0.01)", a GRACE dict, an object
    min_bytes: int = 0
    max_bytes: int = None
    dtypes: tuple = ()
    max_density: float = None        # matches when the densest rank's block density is below this

    def __post_init__(self):
        if self.algorithm not in algorithms():
            raise ConfigError(f"rule {self.pattern!r}: unknown algorithm {self.algorithm!r}; choose one of {algorithms()}")
        if self.max_density is not None and (self.compression is not None or self.algorithm in ("auto", "allgather")
                                             or not 0 < self.max_density <= 1):
            raise ConfigError(f"rule {self.pattern!r}: a density condition needs a bound in (0, 1] and an "
                              f"uncompressed algorithm (ring, switchml or omnireduce), not {self.algorithm!r}"
                              + (f" with {self.compression!r}" if self.compression is not None else ""))
        if self.pattern.startswith("re:"):
            try:
                re.compile(self.pattern[3:])
            except re.error as exc:
                raise ConfigError(f"rule {self.pattern!r}: bad regular expression ({exc})") from None

    def matches(self, name, nbytes, dtype):
        if self.pattern.startswith("re:"):
            if not re.fullmatch(self.pattern[3:], name):
                return False
        elif not fnmatch.fnmatchcase(name, self.pattern):
            return False
        if nbytes < self.min_bytes or (self.max_bytes is not None and nbytes > self.max_bytes):
            return False
        return not self.dtypes or str(dtype) in self.dtypes


class Policy:
    def __init__(self, rules=(), default="auto"):
        self.rules = list(rules) + [Rule("*", default)]

    def choose(self, name, nbytes, dtype):
        """The Choice of the first rule that matches; density rules that match before it become its
        `bounded` choices, which the dispatcher settles with the measured density."""
        bounded = []
        for rule in self.rules:
            if not rule.matches(name, nbytes, dtype):
                continue
            if rule.max_density is not None:
                bounded.append((rule.max_density, rule.algorithm))
                continue
            if bounded and rule.compression is not None:
                raise ConfigError(f"policy: tensor {name!r} matches a density rule whose fallback {rule.pattern!r} "
                                  f"compresses; put an uncompressed rule between them")
            return Choice(rule.algorithm, rule.compression, tuple(bounded))
        raise AssertionError("unreachable: the last rule matches everything")

    @classmethod
    def parse(cls, text):
        rules = [_parse_rule(part) for part in _split_top(text, ";") if part.strip()]
        return cls(rules)

    def __repr__(self):
        return f"Policy({self.rules[:-1]})"


class Choice(NamedTuple):
    """A policy's answer for one tensor: an algorithm (maybe `auto`), a compressor spec, and the
    (density bound, algorithm) choices of density rules that matched before (tried first)."""
    algorithm: str
    compression: object = None
    bounded: tuple = ()


def _split_top(text, sep):
    """Split on `sep` outside of (), [] so compressor arguments may hold separators."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _parse_rule(text):
    head, eq, action = text.strip().partition("=")
    while head.count("[") > head.count("]") and eq:   # '=' inside [dtype=...]
        more, eq, action = action.partition("=")
        head += "=" + more
    if not eq or not action.strip():
        raise ConfigError(f"policy rule {text!r} must read 'pattern[conditions]=algorithm[:compressor]'")
    pattern, _, conditions = head.strip().partition("[")
    kwargs = _parse_conditions(conditions.rstrip("]"), text) if conditions else {}
    action = action.strip()
    algorithm, colon, compression = action.partition(":")
    word = re.match(r"[A-Za-z_]\w*", action)
    if not colon and word and word.group() not in algorithms():
        algorithm, compression = "auto", action     # '*.weight=topk(ratio=0.01)'
    if compression.strip():   # an unknown compressor or one the algorithm cannot carry fails here, not mid-training
        from commlib import compressors
        compressor = compressors.resolve(compression.strip())
        if compressor is not None:
            compressor.check_carrier(algorithm.strip(), f"policy rule {text.strip()!r}")
    return Rule(pattern.strip() or "*", algorithm.strip(), compression.strip() or None, **kwargs)


def _parse_conditions(text, rule):
    kwargs = {}
    for condition in filter(None, (c.strip() for c in text.split(","))):
        key, _, value = condition.partition("=")
        density = re.fullmatch(r"density\s*<\s*([0-9.eE+-]+)", condition)
        if density:
            try:
                kwargs["max_density"] = float(density.group(1))
            except ValueError:
                raise ConfigError(f"policy rule {rule!r}: {condition!r} needs a number, e.g. density<0.05") from None
        elif key == "min":
            kwargs["min_bytes"] = parse_bytes(value)
        elif key == "max":
            kwargs["max_bytes"] = parse_bytes(value)
        elif key == "dtype":
            kwargs["dtypes"] = tuple(value.split("|"))
        else:
            raise ConfigError(f"policy rule {rule!r}: unknown condition {key!r}; use min=, max=, dtype= or "
                              f"density<")
    return kwargs
