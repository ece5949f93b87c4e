"""The package's import map: no circle among its modules (imports inside functions included), and the library
never imports the programs (flax_transformer/commands/); checked on the source, so it fails on the circle a
change adds, before anything runs it."""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'flax_transformer')


def _modules() -> dict[str, str]:
  """Dotted module name -> file, for every module of the package."""
  found = {}
  for folder, _, names in os.walk(ROOT):
    for name in names:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, '.')
        found[dotted.removesuffix('.__init__')] = path
  return found


def import_map() -> dict[str, set[str]]:
  """Each module -> the package's modules it imports anywhere in its file (`from package import name` counts as
  importing the module `name` when there is one, else the package)."""
  modules = _modules()
  edges = {}
  for module, path in modules.items():
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read(), path)
    package = module if path.endswith('__init__.py') else module.rpartition('.')[0]
    targets = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets |= {alias.name for alias in node.names}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ''
        if node.level:  # relative
          base = '.'.join(package.split('.')[:len(package.split('.')) - node.level + 1] + ([base] if base else []))
        for alias in node.names:
          targets.add(f'{base}.{alias.name}' if f'{base}.{alias.name}' in modules else base)
    edges[module] = {t for t in targets if t in modules and t != module and t != 'flax_transformer'}
  return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The import circles of `edges` (Tarjan's strongly connected components with more than one module)."""
  index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

  def visit(node):
    index[node] = low[node] = counter[0]
    counter[0] += 1
    stack.append(node)
    on_stack.add(node)
    for target in edges.get(node, ()):
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        found.append(sorted(component))
  for node in sorted(edges):
    if node not in index:
      visit(node)
  return found


def test_no_module_of_the_package_imports_itself_through_others():
  assert circles(import_map()) == []


def test_the_circle_finder_finds_a_circle():
  assert circles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]


def test_the_library_never_imports_the_programs():
  edges = import_map()
  library = [m for m in edges if not m.startswith('flax_transformer.commands') and m != 'flax_transformer.__main__']
  assert {m: sorted(t for t in edges[m] if t.startswith('flax_transformer.commands')) for m in library
          if any(t.startswith('flax_transformer.commands') for t in edges[m])} == {}
