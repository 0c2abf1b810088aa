"""Every model a config file can reach is strict and documented: a `Section` (unknown keys are
errors, defaults validated, attribute docstrings read as descriptions), none setting its own
`extra`, and every field with a docstring, which `hotloop config show` prints and the
unknown-key error points at."""

from __future__ import annotations

import inspect
import re
import typing

from pydantic import BaseModel

from launch.sections import sections
from hotloop.config import MeshConfig, Section
from hotloop.hardware import Dtype


def _models_in(annotation) -> list[type[BaseModel]]:
    """The models an annotation names: itself, or inside dict/list/Optional/Union/Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def reachable() -> list[type[BaseModel]]:
    """Every model reachable from the shared sections and `sections()`, nested ones included."""
    seen: list[type[BaseModel]] = []
    todo = [MeshConfig, *sections().values()]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            todo += _models_in(field.annotation)
    return seen


def test_the_walk_reaches_the_nested_models():
    names = {m.__name__ for m in reachable()}
    # a nested section, a dict of entries, and a model only a service's section names
    assert {"LossSettings", "TenantConfig", "RegexRule", "SandboxConfig", "UpReplicas"} <= names


def test_every_config_model_is_a_section_and_none_sets_its_own_extra():
    models = reachable()
    assert len(models) > 20
    not_sections = [m.__qualname__ for m in models if not issubclass(m, Section)]
    assert not not_sections
    # pydantic merges every base's model_config into each class's, so read what the class says
    own_extra = {cls.__qualname__ for m in models for cls in m.__mro__[:m.__mro__.index(Section)]
                 if re.search(r"model_config\s*=.*\bextra\s*=", inspect.getsource(cls))}
    assert not own_extra
    assert all(m.model_config["extra"] == "forbid" for m in models)


def test_every_field_of_every_config_model_has_a_docstring():
    undocumented = [f"{m.__module__}.{m.__qualname__}.{name}"
                    for m in reachable() for name, f in m.model_fields.items() if not f.description]
    assert not undocumented


def test_every_dtype_a_config_names_is_the_resolvers_type():
    # one list of names for every copy of the base model and every reward model; code turns
    # them into torch dtypes through hotloop.hardware.torch_dtype alone
    dtypes = [(m.__qualname__, f.annotation) for m in reachable()
              for name, f in m.model_fields.items() if name == "dtype"]
    assert len(dtypes) >= 4  # [model], [trainer], [reference], a reward model
    assert all(annotation == Dtype for _, annotation in dtypes), dtypes
