"""Length-bounded JSON strings as chains of rules, so that xgrammar fills their masks fast.

xgrammar (0.2.8) compiles a schema string with ``minLength``/``maxLength`` into a counted
repetition, ``"\\"" X_characters{m, n} "\\""``, whose masks cost 10-50x more to fill than an
unbounded string's (mlc-ai/xgrammar#852: its parser keeps a state per possible count alive). The
same language written as a chain, one rule per count of characters consumed,

    X_n0 ::= "\\"" | CHAR X_n1 | ESCAPE X_n1      (the quote only once i >= m; no step past n)

keeps one parser state alive, and each rule's token mask is precomputed at compile time (about
20x faster fills on SmolLM2's vocabulary; compile time grows by ~15 ms per rule on one core,
so a grammar gets at most ``CHAIN_BUDGET`` chain rules and longer bounds keep xgrammar's form).

The chain also fixes the bounded strings' character set: xgrammar allows raw control characters
and no escapes in them; the chain takes JSON's string characters and escapes (an escape counts as
one character, as ``maxLength`` counts the decoded string; ``\\u`` escapes of UTF-16 surrogates
are left out, since a pair decodes to one character but would count as two).
"""
from __future__ import annotations

import re
from typing import Any

CHAIN_BUDGET = 200  # chain rules per grammar (each adds compile time)

# The exact text xgrammar prints for a bounded string rule and its character rule.
_BOUNDED = re.compile(r'^(?P<name>\w+) ::= \(\("\\"" (?P=name)_characters\{(?P<lo>\d+), (?P<hi>-?\d+)\} "\\""\)\)$',
                      re.MULTILINE)
_CHARACTERS = r'{name}_characters ::= (([^\"\\\r\n]))'
_CHAR = r'[^\0-\x1f\"\\]'
_HEX = "[0-9A-Fa-f]"
_ESCAPE = (r'("\\" ([\"\\/bfnrt] | "u" ([0-9A-Ca-cE-Fe-f] ' + f"{_HEX} {_HEX} {_HEX} | [Dd] [0-7] {_HEX} {_HEX})))")


def chain_rules(name: str, lo: int, hi: int) -> list[str]:
    """``name`` as a chain: ``name_n{i}`` has consumed i characters; ``hi < 0`` is unbounded
    (the last rule loops)."""
    last = lo if hi < 0 else hi
    rules = [f'{name} ::= (("\\"" {name}_n0))']
    for i in range(last + 1):
        nxt = f"{name}_n{i + 1}" if i < last else (f"{name}_n{i}" if hi < 0 else None)
        alts = ['("\\"")'] if i >= lo else []
        if nxt is not None:
            alts += [f"({_CHAR} {nxt})", f"({_ESCAPE} {nxt})"]
        rules.append(f"{name}_n{i} ::= ({' | '.join(alts)})")
    return rules


def chain_bounded_strings(ebnf: str, budget: int = CHAIN_BUDGET) -> str:
    """The grammar text with each bounded string rule (while the budget lasts) as a chain."""
    lines = ebnf.splitlines()
    chains: dict[str, list[str]] = {}  # a bounded rule's line → its chain
    dropped: set[str] = set()  # the chained rules' character rules
    for m in _BOUNDED.finditer(ebnf):
        name, lo, hi = m["name"], int(m["lo"]), int(m["hi"])
        characters = _CHARACTERS.format(name=name)
        size = (lo if hi < 0 else hi) + 2
        taken = any(line.startswith(f"{name}_n") for line in lines)  # a chain's names in use
        if size > budget or characters not in lines or taken or 0 <= hi < lo:
            continue
        budget -= size
        chains[m.group(0)] = chain_rules(name, lo, hi)
        dropped.add(characters)
    if not chains:
        return ebnf
    out = []
    for line in lines:
        if line not in dropped:
            out.extend(chains.get(line, [line]))
    return "\n".join(out)


def with_chained_strings(grammar: Any) -> Any:
    """``grammar`` (an ``xgrammar.Grammar``) with its bounded strings chained; unchanged where it
    has none, or where its text does not read back as the same grammar (another xgrammar's
    printing)."""
    import xgrammar as xgr

    from pagedllm import envs

    if not envs.PAGEDLLM_CHAIN_STRINGS:
        return grammar
    text = str(grammar)
    chained = chain_bounded_strings(text)
    if chained == text or str(xgr.Grammar.from_ebnf(text)) != text:
        return grammar
    return xgr.Grammar.from_ebnf(chained)
