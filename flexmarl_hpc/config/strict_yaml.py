"""YAML for configs: PyYAML's safe loader with duplicate keys refused and size limits.

    from flexmarl_hpc.config.strict_yaml import YAMLLimitError, strict_load
    data = strict_load(text)     # yaml.YAMLError (with .problem and .problem_mark) if refused

Plain `yaml.safe_load` takes the last of two equal keys silently (a second top-level `run:`
replaced the first whole), builds a "billion laughs" alias bomb into ~10^9 references that
the config checks then walk for minutes, and hits RecursionError (a 3,000-line traceback)
on nesting a few thousand levels deep. Here each of these is a YAMLError naming the line,
raised before anything is built: nesting is counted while composing, and the composed
graph's size with every alias expanded is counted (once per distinct node, so the count
itself is cheap) before constructing.
"""
from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, SequenceNode

MAX_DEPTH = 100
"""Nesting levels a config may have (the deepest shipped config has 6)."""
MAX_NODES = 200_000
"""Scalars, lists and mappings a config may hold once every alias is expanded (the largest
shipped config has a few hundred; an alias bomb of 9 levels has 10^9)."""


class YAMLLimitError(yaml.YAMLError):
    """A document over MAX_DEPTH or MAX_NODES; `problem`/`problem_mark` as PyYAML's errors."""

    def __init__(self, problem: str, mark: Any = None):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys and documents over the limits."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        # counted here, where PyYAML recurses, so the limit trips long before Python's
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YAMLLimitError(f"nested deeper than {MAX_DEPTH} levels (the config limit)",
                                     self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, 1)
        return self.construct_document(node)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":     # `<<: *base` merges, and may repeat
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:               # an unhashable key: SafeLoader's own error follows
                break
            if first is not key_node.start_mark:
                raise ConstructorError(None, None, f"duplicate key {key!r} (first at line {first.line + 1})",
                                       key_node.start_mark)
        return super().construct_mapping(node, deep)



def _expanded_size(node: Node, sizes: dict[int, int | None], depth: int) -> int:
    """Nodes under `node` with aliases expanded; each distinct node is visited once (its size
    is memoised by identity), a node met again while it is being counted is a cycle. The
    expanded nesting is held to MAX_DEPTH too (aliases inside aliases nest deeper than the text)."""
    if depth > MAX_DEPTH:
        raise YAMLLimitError(f"aliases nest deeper than {MAX_DEPTH} levels (the config limit)",
                             node.start_mark)
    if id(node) in sizes:
        size = sizes[id(node)]
        if size is None:
            raise YAMLLimitError("an alias refers to a node that contains it (a recursive "
                                 "structure is not a config)", node.start_mark)
        return size
    size = 1
    if isinstance(node, (SequenceNode, MappingNode)):
        sizes[id(node)] = None
        children = node.value if isinstance(node, SequenceNode) else [n for kv in node.value for n in kv]
        size += sum(_expanded_size(c, sizes, depth + 1) for c in children)
    if size > MAX_NODES:
        raise YAMLLimitError(f"aliases expand to more than {MAX_NODES} nodes (the config limit; "
                             "an alias bomb?)", node.start_mark)
    sizes[id(node)] = size
    return size


def strict_load(text: str) -> Any:
    """`yaml.safe_load` with duplicate keys, over-deep nesting and alias bombs refused."""
    return yaml.load(text, Loader=StrictLoader)
