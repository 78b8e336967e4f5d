"""Tensor names for a step's gradients (no TensorFlow import: Keras 3's torch backend uses it too)."""


def tensor_names(vars, count, use_generic_names=False):
    """One name per gradient: the variable's name without TF's ":0", or grad_<i> (as Horovod's
    use_generic_names); a repeated name gets "#<i>" so every tensor of a step is distinct. A source
    without a name (an eager tensor the tape watches) is grad_<i>."""
    if vars is None or use_generic_names:
        return [f"grad_{i}" for i in range(count)]
    names, seen = [], set()
    for i, var in enumerate(vars):
        try:
            name = getattr(var, "path", None) or var.name   # Keras 3 variables: path is the unique one
        except AttributeError:   # TF's eager tensors raise it: "Tensor.name is undefined"
            name = f"grad_{i}"
        name = name.split(":")[0]
        if name in seen:
            name = f"{name}#{i}"
        seen.add(name)
        names.append(name)
    return names
