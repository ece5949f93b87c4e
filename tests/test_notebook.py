"""The quickstart notebook runs top to bottom on CPU in its tiny setting, and its figures render."""

import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, 'notebooks', 'quickstart.ipynb')


def test_notebook_is_paired_with_its_jupytext_script():
  import jupytext
  notebook = jupytext.read(NOTEBOOK)
  script = jupytext.read(os.path.join(ROOT, 'notebooks', 'quickstart.py'))
  assert [c.source for c in notebook.cells] == [c.source for c in script.cells]


@pytest.mark.slow
def test_quickstart_executes_and_draws(tmp_path, monkeypatch):
  from nbclient import NotebookClient
  if not os.path.exists(os.path.join(ROOT, '..', 'shared', 'data', 'multi30k', 'val.en.gz')):
    pytest.skip('../shared/data/multi30k is not beside this checkout')
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  monkeypatch.setenv('FLAX_TRANSFORMER_NOTEBOOK_TINY', '1')  # the kernel inherits these; later tests do not
  monkeypatch.setenv('NOTEBOOK_WORKDIR', str(tmp_path / 'work'))
  monkeypatch.setenv('MPLBACKEND', 'module://matplotlib_inline.backend_inline')
  client = NotebookClient(notebook, timeout=170, kernel_name='python3',
                          resources={'metadata': {'path': os.path.join(ROOT, 'notebooks')}})
  client.execute()  # raises CellExecutionError on any failing cell
  figure_cells = [c for c in notebook.cells if c.cell_type == 'code' and 'plt.show()' in c.source]
  images = [sum('image/png' in output.get('data', {}) for output in cell.outputs) for cell in figure_cells]
  # schedule, positional encodings, training curve, and two attention figures in the last cell
  assert len(images) == 4 and min(images) >= 1 and images[-1] == 2, images
