"""Run in a subprocess with another transformers first on PYTHONPATH: load each exported directory with the class
its config.json names (`architectures`) and compare its outputs with the expected ones. argv: a manifest written by
the test: [{"dir", "inputs" (a .pt file), "expected" (a .pt file of {output name: tensor})}]. Prints one JSON line;
an expected name "hidden_states:i" is hidden_states[i]."""

import json
import sys

import torch
import transformers


def main(manifest_path: str) -> None:
    report = {"version": transformers.__version__, "models": []}
    for entry in json.load(open(manifest_path)):
        with open(f"{entry['dir']}/config.json") as f:
            model_class = getattr(transformers, json.load(f)["architectures"][0])
        model, info = model_class.from_pretrained(entry["dir"], output_loading_info=True)
        images = torch.load(entry["inputs"])
        expected = torch.load(entry["expected"])
        with torch.no_grad():
            out = model.eval()(pixel_values=images, output_hidden_states=True)
        errors = {}
        for name, value in expected.items():
            if name.startswith("hidden_states:"):
                got = out.hidden_states[int(name.split(":")[1])]
            else:
                got = getattr(out, name)
            errors[name] = float((got - value).abs().max())
        report["models"].append({"dir": entry["dir"], "class": type(model).__name__, "errors": errors,
                                 "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                                 "mismatched": [list(map(str, m)) for m in info.get("mismatched_keys", [])]})
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
