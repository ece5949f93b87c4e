"""The programs' one runner (commands.run_program): exit statuses, --help, the one error line, Ctrl-C; and the
`python -m flax_transformer.<program>` modules that hand over to the programs in commands/."""

import ast
import os
import subprocess
import sys

import pytest

from flax_transformer import commands
from flax_transformer.errors import UserError
from tests.conftest import ROOT, subprocess_env
from tests.helpers import programs


def _program(work):
  def define(flag_values, argv):
    from absl import flags
    flags.DEFINE_string('name', None, 'A name.', flag_values=flag_values)
    flags.DEFINE_integer('count', 1, 'A count.', flag_values=flag_values)
  return lambda argv: commands.run_program(argv, define, work, 'The test program: says hello.', required=('name',))


def _raise(error):
  def work(f):
    raise error
  return work


@pytest.mark.parametrize('argv,work,status,line', [
    (['p', '--name=a'], lambda f: print(f'hello {f.name} x{f.count}'), 0, None),
    (['p', '--nmae=a'], None, 2, "error: Unknown command line flag 'nmae'. Did you mean: name ?; see --help"),
    (['p', '--name=a', '--count=many'], None, 2, "error: flag --count=many: invalid literal for int() with base 10"),
    (['p'], None, 2, 'error: --name is required; see --help'),
    (['p', '--name=a', 'extra'], None, 2, "error: unexpected arguments ['extra']: every flag is written --name=value"),
    (['p', '--name=a'], _raise(UserError('the input is bad\nin two lines')), 1, 'error: the input is bad in two lines'),
    (['p', '--name=a'], _raise(KeyboardInterrupt()), 130, 'error: interrupted (Ctrl-C); nothing is left half-written'),
])
def test_every_ending_is_an_exit_status_and_at_most_one_error_line(argv, work, status, line):
  result = programs.run(_program(work or (lambda f: None)), argv, text=True)
  assert result.returncode == status
  errors = [l for l in result.stderr.splitlines() if l.startswith('error: ')]
  assert errors == ([] if line is None else [errors[0]]) and (line is None or errors[0].startswith(line)), result.stderr
  if status == 0:
    assert result.stdout == 'hello a x1\n'


def test_help_prints_the_programs_doc_and_flags():
  result = programs.run(_program(lambda f: None), ['p', '--help'], text=True)
  assert result.returncode == 0 and result.stdout.startswith('The test program: says hello.')
  assert '--name' in result.stdout and '--count' in result.stdout


def test_python_dash_m_flax_transformer_hands_over_to_each_program():
  """`python -m flax_transformer PROGRAM` runs commands/<module>.py's console for every installed command, and
  imports nothing else first (the plan must set the device count before JAX starts)."""
  from importlib.metadata import entry_points

  from flax_transformer import __main__ as dispatcher
  installed = {e.name.removeprefix('flax-transformer-'): e.value for e in entry_points(group='console_scripts')
               if e.name.startswith('flax-transformer-')}
  assert {name: f'flax_transformer.commands.{module}:console' for name, module in dispatcher.PROGRAMS.items()} == installed
  tree = ast.parse(open(os.path.join(ROOT, 'flax_transformer', '__main__.py')).read())
  assert {ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))} == {
      'import importlib', 'import sys'}
  result = subprocess.run([sys.executable, '-m', 'flax_transformer', 'nonsense'], capture_output=True, text=True,
                          timeout=60)
  assert result.returncode == 2 and result.stderr.startswith("error: 'nonsense' is not a program; usage: python -m "
                                                             'flax_transformer {train,translate,serve,')


@pytest.mark.parametrize('module,program', [('average', 'average'), ('export', 'export'), ('plan', 'plan'),
                                            ('input_pipeline', 'inspect')])
def test_a_library_module_run_as_a_program_names_the_new_spelling(module, program):
  """`python -m flax_transformer.<module>` (the old spelling) says the new one in one line: the module's last
  statement, after everything it defines, so the module is loaded once and imports no program."""
  tree = ast.parse(open(os.path.join(ROOT, 'flax_transformer', f'{module}.py')).read())
  last = tree.body[-1]
  assert isinstance(last, ast.If) and ast.unparse(last.test) == "__name__ == '__main__'"
  assert [ast.unparse(node) for node in last.body] == ['from flax_transformer.__main__ import moved',
                                                        f"moved('{module}', '{program}')"]
  if module == 'average':
    result = subprocess.run([sys.executable, '-m', 'flax_transformer.average', '--workdir=x'], capture_output=True,
                            text=True, timeout=120, env=subprocess_env())
    assert result.returncode == 2 and result.stderr.splitlines() == [
        'error: python -m flax_transformer.average is now python -m flax_transformer average (or '
        'flax-transformer-average); the same flags']


def _imports(path: str) -> set[str]:
  """The package modules `path` imports, wherever the import stands (TYPE_CHECKING, function bodies and
`if __name__ == '__main__':` too)."""
  tree, found = ast.parse(open(path).read()), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('flax_transformer'):
      names = [node.module] if node.module != 'flax_transformer' else [f'flax_transformer.{a.name}' for a in node.names]
      found.update(n.removeprefix('flax_transformer.') for n in names)
    elif isinstance(node, ast.Import):
      found.update(a.name.removeprefix('flax_transformer.') for a in node.names if a.name.startswith('flax_transformer.'))
  return found


def _package_graph() -> dict[str, set[str]]:
  graph = {}
  for root, _, files in os.walk(os.path.join(ROOT, 'flax_transformer')):
    for name in files:
      if name.endswith('.py') and name != '__init__.py':
        path = os.path.join(root, name)
        module = os.path.relpath(path, os.path.join(ROOT, 'flax_transformer'))[:-3].replace(os.sep, '.')
        graph[module] = {m for m in _imports(path) if m != module}
  return graph


def test_the_library_never_imports_the_programs_and_the_import_map_has_no_circle():
  graph = _package_graph()
  library = {m: deps for m, deps in graph.items() if not m.startswith('commands') and m != '__main__'}
  assert not {m: sorted(d for d in deps if d.startswith('commands')) for m, deps in library.items()
              if any(d.startswith('commands') for d in deps)}
  depth, visiting = {}, []

  def floor(module):  # 0 for a module importing no package module; a circle fails here
    assert module not in visiting, f'import circle: {" -> ".join(visiting[visiting.index(module):] + [module])}'
    if module not in depth:
      visiting.append(module)
      depth[module] = 1 + max((floor(d) for d in graph.get(module, ()) if d in graph), default=-1)
      visiting.pop()
    return depth[module]
  print('floors:', {m: floor(m) for m in sorted(graph)}, 'deepest', max(map(floor, graph)))
