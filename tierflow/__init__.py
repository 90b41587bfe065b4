"""tierflow: plan, simulate and execute training of models larger than GPU memory over GPU, CPU memory and
NVMe SSDs.

Layers, each importing only the ones before it:

- ``tierflow.hwprofiles``: hardware profiles (folder ``hwprofiles/``);
- ``tierflow.planner``: the simulator core (``planner.core``), the search (``planner.search``) and
  input/output (``planner.io``: plan files, compare, the DeepSpeed bridge), never importing torch (folder
  ``planner/``);
- ``tierflow.executor``: replays plan files with PyTorch, and calibrates a box (folder ``executor/``);
- ``tierflow.cli``: the ``tierflow`` command, one module per subcommand (folder ``tierflow/cli/``).

``tierflow.api`` is the public Python API; nothing inside the package imports it.
"""

__version__ = "0.2.0"
