"""How a config setting is declared: once, on its section dataclass's field.

A field made with :func:`setting` carries, in its ``dataclasses.field`` metadata, the
parser of its TOML value and a one-line doc. The parser table of a section
(:func:`parsers`) and the resolved config ``kvguard check-config`` prints are both
derived from these fields, so adding a setting is one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, TypeVar

from kvguard.config.fields import Parser

T = TypeVar("T")
_KEY = "kvguard.setting"


@dataclass(frozen=True)
class Setting:
    """What a field's metadata says about it."""

    parse: Parser | None  # None: not read from the file as such (a secret read from a file)
    doc: str
    # The key in the file, where it is not the field's name; "section.key" for a setting
    # of Config itself, read from a section's table ([pattern] window_s).
    key: str | None = None
    shown: Callable[[Any], object] | None = None  # how check-config shows it (None: plainly)
    shown_last: bool = False  # shown after the section's other settings
    shown_as: str | None = None  # where check-config shows it ("section.key"), if not its name


def about(
    parse: Parser | None,
    doc: str,
    *,
    key: str | None = None,
    shown: Callable[[Any], object] | None = None,
    shown_last: bool = False,
    shown_as: str | None = None,
) -> Mapping[str, Setting]:
    """Field metadata declaring a setting: ``field(..., metadata=about(...))``.

    For the fields :func:`setting` cannot make: one without a default, one whose default
    a linter cannot see is immutable.
    """
    return {_KEY: Setting(parse, doc, key, shown, shown_last, shown_as)}


def setting(
    default: T,
    parse: Parser | None,
    doc: str,
    *,
    key: str | None = None,
    shown: Callable[[Any], object] | None = None,
    shown_last: bool = False,
    shown_as: str | None = None,
    compare: bool = True,
    repr: bool = True,  # noqa: A002 - the name dataclasses.field gives it
) -> T:
    """A dataclass field holding a setting: its default, its parser and what it is."""
    metadata = about(parse, doc, key=key, shown=shown, shown_last=shown_last, shown_as=shown_as)
    return field(default=default, metadata=metadata, compare=compare, repr=repr)


def setting_factory(
    factory: Callable[[], T],
    parse: Parser | None,
    doc: str,
    *,
    shown: Callable[[Any], object] | None = None,
    shown_last: bool = False,
    compare: bool = True,
    repr: bool = True,  # noqa: A002 - the name dataclasses.field gives it
) -> T:
    """:func:`setting` for a mutable default, made afresh for each instance."""
    metadata = about(parse, doc, shown=shown, shown_last=shown_last)
    return field(default_factory=factory, metadata=metadata, compare=compare, repr=repr)


def setting_of(spec: Field[Any]) -> Setting | None:
    """The setting a dataclass field declares (None: the field is no setting)."""
    found = spec.metadata.get(_KEY)
    return found if isinstance(found, Setting) else None


def parsers(section: type) -> dict[str, Parser]:
    """The parser of each key of ``section``'s table, keyed as in the file, in field order."""
    table: dict[str, Parser] = {}
    for spec in fields(section):
        declared = setting_of(spec)
        if declared is not None and declared.parse is not None:
            table[declared.key or spec.name] = declared.parse
    return table


def renamed(section: type) -> dict[str, str]:
    """The field name of each key of ``section``'s table that is named otherwise."""
    return {
        declared.key: spec.name
        for spec in fields(section)
        if (declared := setting_of(spec)) is not None and declared.key is not None
    }
