"""Every source format lists what its files hold: boxes, names, masks, captions, columns; hostile files are refused."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

from pipeline import demo
from pipeline.errors import ConfigError, SourceError
from pipeline.io.tar import sample_tar_bytes
from pipeline.prepare.listing import Listing, class_names
from pipeline.prepare.sources import ListingInfo, SourceItem, list_images


def _list(source, split: str | None = None) -> tuple[list[SourceItem], ListingInfo]:
    info = ListingInfo()
    items = list(list_images(str(source), info, split=split))
    return items, info


def _spilled(tmp_path, items) -> tuple[list[SourceItem], set[str]]:
    listing = Listing(str(tmp_path))
    count, _, labels = listing.write(iter(items))
    back = [listing.get(i) for i in range(count)]
    listing.close()
    return back, labels


# -- SourceItem round trip --------------------------------------------------------


@pytest.mark.parametrize(
    "item",
    [
        SourceItem("/d/a.jpg", "a.jpg", "cat"),
        SourceItem("/d/a.jpg", "a.jpg", None, "not an image"),
        SourceItem("/d/a.jpg", "a.jpg", None, targets={"boxes": [[0.5, 1, 2, 3.25]], "box_labels": ["cat"], "iscrowd": [1]}),
        SourceItem("/d/s.tar", "s.tar/k", "dog", targets={"tar": {"offset": 512, "size": 9}, "caption": "ünï\n", "columns": {"a": [1, None]}}),
    ],
)
def test_source_item_json_round_trip(item):
    assert SourceItem.from_json(item.to_json()) == item


def test_a_plain_item_is_written_as_before():
    assert SourceItem("/d/a.jpg", "a.jpg", "cat").to_json() == '["/d/a.jpg", "a.jpg", "cat"]'


# -- CSV / JSONL columns ------------------------------------------------------------


def test_plain_path_label_list_is_unchanged(tmp_path):
    (tmp_path / "list.csv").write_text("path,label\na.jpg,cat\nb.jpg,\n")
    items, info = _list(tmp_path / "list.csv")
    assert items == [SourceItem(f"{tmp_path}/a.jpg", "a.jpg", "cat"), SourceItem(f"{tmp_path}/b.jpg", "b.jpg", None)]
    assert (info.kind, info.task) == ("list", "classification")
    (tmp_path / "list.jsonl").write_text('{"path": "a.jpg", "label": 3}\n{"path": "b.jpg"}\n')
    items, _ = _list(tmp_path / "list.jsonl")
    assert items == [SourceItem(f"{tmp_path}/a.jpg", "a.jpg", "3"), SourceItem(f"{tmp_path}/b.jpg", "b.jpg", None)]
    assert all(item.targets is None for item in items)


def test_csv_labels_caption_and_other_columns(tmp_path):
    (tmp_path / "list.csv").write_text(
        'path,labels,caption,id\na.jpg,cat;dog,a cat and a dog,7\nb.jpg,"[""bird""]",,8\nc.jpg,,,9\n'
    )
    items, info = _list(tmp_path / "list.csv")
    assert [item.targets for item in items] == [
        {"labels": ["cat", "dog"], "caption": "a cat and a dog", "columns": {"id": "7"}},
        {"labels": ["bird"], "caption": "", "columns": {"id": "8"}},
        {"labels": [], "caption": "", "columns": {"id": "9"}},
    ]
    assert info.task == "multilabel"
    back, labels = _spilled(tmp_path, items)
    assert back == items
    assert labels == {"cat", "dog", "bird"}
    assert class_names(info, labels) == ["bird", "cat", "dog"]


def test_jsonl_labels_as_a_list_and_digit_names_become_indices(tmp_path):
    rows = [{"path": "a.jpg", "labels": [0, 4]}, {"path": "b.jpg", "labels": "2;4", "meta": {"k": [1, 2]}}]
    (tmp_path / "list.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, info = _list(tmp_path / "list.jsonl")
    assert [item.targets for item in items] == [{"labels": ["0", "4"]}, {"labels": ["2", "4"], "columns": {"meta": {"k": [1, 2]}}}]
    _, labels = _spilled(tmp_path, items)
    assert class_names(info, labels) == ["0", "1", "2", "3", "4"]


def test_jsonl_captions_without_labels_is_a_captions_task(tmp_path):
    rows = [{"path": "a.jpg", "text": "a red square"}, {"path": "b.jpg", "caption": "two"}]
    (tmp_path / "list.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, info = _list(tmp_path / "list.jsonl")
    assert [item.targets for item in items] == [{"caption": "a red square"}, {"caption": "two"}]
    assert info.task == "captions"


def test_bad_list_cells_reject_their_row(tmp_path):
    rows = [{"path": "a.jpg", "caption": 5}, {"path": "b.jpg", "labels": {"x": 1}}, {"path": "c.jpg", "labels": "[1,"}]
    (tmp_path / "list.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, _ = _list(tmp_path / "list.jsonl")
    assert [bool(item.rejected) for item in items] == [True, True, True]
    assert "caption" in items[0].rejected and "labels" in items[1].rejected and "JSON list" in items[2].rejected


# -- COCO ------------------------------------------------------------------------


def _scene_boxes(index, classes=3):
    scene = demo.demo_scene(index, classes=classes)
    return scene, [list(map(float, box)) for box in scene.boxes], [demo.OBJECT_CLASSES[c] for c in scene.labels]


def test_coco_lists_the_boxes_the_generator_drew(tmp_path):
    path = demo.make_coco_dataset(tmp_path, 12, classes=3)
    items, info = _list(path)
    assert (info.kind, info.task, info.classes) == ("coco", "detection", ["cat", "dog", "bird"])
    assert len(items) == 12
    for index, item in enumerate(items):
        scene, boxes, names = _scene_boxes(index)
        assert item.url == str(tmp_path / "train" / f"{index:06d}.jpg")
        assert not item.rejected
        assert item.targets["boxes"] == boxes
        assert item.targets["box_labels"] == names
        assert item.targets["iscrowd"] == list(scene.crowd)
        assert item.targets["columns"] == {"image_id": index + 1}
        if boxes:
            assert item.targets["segmentation"][0] == [[b for b in (boxes[0][0], boxes[0][1], boxes[0][2], boxes[0][1],
                                                        boxes[0][2], boxes[0][3], boxes[0][0], boxes[0][3])]]
    assert items[5].targets["boxes"] == []  # an image without annotations is kept
    _, labels = _spilled(tmp_path / "annotations", items)
    assert class_names(info, labels) == ["cat", "dog", "bird"]


def _coco(tmp_path, images=None, annotations=None, categories=None, name="instances.json"):
    coco = {
        "images": images if images is not None else [{"id": 1, "file_name": "a.jpg", "width": 50, "height": 40}],
        "annotations": annotations if annotations is not None else [],
        "categories": categories if categories is not None else [{"id": 7, "name": "zebra"}, {"id": 2, "name": "ant"}],
    }
    (tmp_path / "a.jpg").write_bytes(b"x")
    path = tmp_path / name
    path.write_text(json.dumps(coco))
    return path


def test_coco_categories_sort_by_id_and_images_resolve_beside_the_json(tmp_path):
    path = _coco(tmp_path, annotations=[{"id": 1, "image_id": 1, "category_id": 7, "bbox": [1.5, 2, 3, 4]}])
    items, info = _list(path)
    assert info.classes == ["ant", "zebra"]
    assert items == [SourceItem(f"{tmp_path}/a.jpg", "a.jpg", None, targets={
        "boxes": [[1.5, 2.0, 4.5, 6.0]], "box_labels": ["zebra"], "iscrowd": [0], "columns": {"image_id": 1},
        "frame": "declared", "declared_size": [50, 40]})]


@pytest.mark.parametrize(
    "annotation, reason",
    [
        ({"bbox": [1, 2, 3]}, "four finite numbers"),
        ({"bbox": [1, 2, "3", 4]}, "four finite numbers"),
        ({"bbox": [1, 2, -3, 4]}, "negative"),
        ({"bbox": [40, 2, 30, 4]}, "passes the edge"),
        ({"category_id": 99}, "category_id 99 is not one of the categories"),
        ({"iscrowd": 3}, "iscrowd"),
        ({"segmentation": "poly"}, "segmentation"),
    ],
)
def test_a_bad_coco_annotation_rejects_its_image(tmp_path, annotation, reason):
    good = {"id": 1, "image_id": 1, "category_id": 2, "bbox": [1, 2, 3, 4]}
    path = _coco(tmp_path, annotations=[good, {**good, "id": 2, **annotation}])
    items, _ = _list(path)
    assert len(items) == 1 and reason in items[0].rejected and items[0].rejected.startswith("annotation 2:")


def test_a_non_finite_coco_box_rejects_its_image(tmp_path):
    path = _coco(tmp_path)
    text = path.read_text().replace('"annotations": []', '"annotations": [{"id": 1, "image_id": 1, "category_id": 2, "bbox": [NaN, 0, 1, 1]}]')
    path.write_text(text)
    items, _ = _list(path)
    assert "finite" in items[0].rejected


def test_coco_annotations_of_unknown_images_are_dropped_and_counted(tmp_path):
    path = _coco(tmp_path, annotations=[{"id": 1, "image_id": 42, "category_id": 2, "bbox": [1, 2, 3, 4]}, "junk"])
    items, info = _list(path)
    assert items[0].targets["boxes"] == [] and info.ignored == 2


@pytest.mark.parametrize("name", ["../escape.jpg", "/etc/passwd", "a/../../b.jpg", 5])
def test_a_coco_file_name_leaving_the_folder_is_rejected(tmp_path, name):
    path = _coco(tmp_path, images=[{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": name}])
    items, _ = _list(path)
    assert not items[0].rejected and "not a path inside the dataset folder" in items[1].rejected


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "not a COCO annotation file"),
        ('{"images": [], "annotations": []}', "not a COCO annotation file"),
        ('{"images": [', "not valid JSON"),
        ('{"images": [], "annotations": [], "categories": [{"id": "x", "name": "a"}]}', "integer 'id'"),
        ('{"images": [], "annotations": [], "categories": [{"id": 1, "name": "a"}, {"id": 1, "name": "b"}]}', "twice"),
        ('{"images": [], "annotations": [], "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "a"}]}', "share a name"),
    ],
)
def test_a_json_that_is_not_coco_is_refused(tmp_path, text, message):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(ConfigError, match=message):
        _list(tmp_path / "x.json")


def test_a_coco_json_over_the_bound_is_refused(tmp_path, monkeypatch):
    path = _coco(tmp_path)
    monkeypatch.setenv("GPUFEED_MAX_JSON_BYTES", "50")
    with pytest.raises(ConfigError, match="over the bound"):
        _list(path)


def test_a_json_lines_file_named_json_is_a_list(tmp_path):
    (tmp_path / "x.json").write_text('{"path": "a.jpg", "label": "cat"}\n{"path": "b.jpg", "label": "dog"}\n')
    items, info = _list(tmp_path / "x.json")
    assert info.kind == "list" and [item.label for item in items] == ["cat", "dog"]


def test_coco_images_not_found_anywhere_is_a_source_error(tmp_path):
    path = _coco(tmp_path)
    os.remove(tmp_path / "a.jpg")
    with pytest.raises(SourceError, match="cannot find the images"):
        _list(path)


def test_a_folder_of_coco_annotations_names_the_json_to_give(tmp_path):
    demo.make_coco_dataset(tmp_path, 2)
    os.rename(tmp_path / "train", tmp_path / "images")
    with pytest.raises(ConfigError, match="instances_train.json"):
        _list(tmp_path)


# -- YOLO ------------------------------------------------------------------------


@pytest.mark.parametrize("as_dict", [False, True])
def test_yolo_lists_normalised_boxes_and_names(tmp_path, as_dict):
    root = demo.make_yolo_dataset(tmp_path, 12, classes=3, names_as_dict=as_dict)
    items, info = _list(root, "train")
    more, _ = _list(root, "val")
    assert (info.kind, info.task, info.classes) == ("yolo", "detection", ["cat", "dog", "bird"])
    assert len(items) == len(more) == 6
    for item in items + more:
        index = int(os.path.basename(item.rel)[:6])
        scene, boxes, names = _scene_boxes(index)
        split = ("train", "val")[index % 2]
        assert item.rel == f"images/{split}/{index:06d}.jpg"
        assert item.targets["normalized"] is True and item.targets["box_labels"] == names
        got = [[v * s for v, s in zip(box, (scene.width, scene.height) * 2)] for box in item.targets["boxes"]]
        assert got == [pytest.approx(box, abs=1e-6) for box in boxes]


def test_yolo_without_names_labels_boxes_by_id(tmp_path):
    root = demo.make_yolo_dataset(tmp_path, 6, splits=())
    os.remove(tmp_path / "data.yaml")
    items, info = _list(root)
    assert info.kind == "yolo" and info.classes == []
    _, labels = _spilled(tmp_path / "labels", items)
    assert labels <= {"0", "1", "2"} and class_names(info, labels) == [str(i) for i in range(int(max(labels)) + 1)]


@pytest.mark.parametrize(
    "line, reason",
    [
        ("0 0.5 0.5 0.2", "fields"),
        ("0 0.5 0.5 0.2 x", "not a number"),
        ("0 0.5 nan 0.2 0.2", "normalised"),
        ("0 1.5 0.5 0.2 0.2", "normalised"),
        ("-1 0.5 0.5 0.2 0.2", "not a class id"),
        ("7 0.5 0.5 0.2 0.2", "box label '7' is not one of the 3 classes in data.yaml"),
    ],
)
def test_a_malformed_yolo_line_rejects_its_image_with_the_line_number(tmp_path, line, reason):
    demo.make_yolo_dataset(tmp_path, 1, splits=())
    (tmp_path / "labels" / "000000.txt").write_text(f"1 0.5 0.5 0.2 0.2\n{line}\n")
    items, _ = _list(tmp_path)
    assert items[0].rejected.startswith("labels/000000.txt:2: ") and reason in items[0].rejected


def test_a_yolo_polygon_line_gives_its_bounds(tmp_path):
    demo.make_yolo_dataset(tmp_path, 1, splits=())
    (tmp_path / "labels" / "000000.txt").write_text("2 0.1 0.2 0.5 0.3 0.3 0.9\n")
    items, _ = _list(tmp_path)
    assert items[0].targets["boxes"] == [[0.1, 0.2, 0.5, 0.9]] and items[0].targets["box_labels"] == ["bird"]


def test_a_yolo_label_file_linking_out_is_rejected(tmp_path):
    demo.make_yolo_dataset(tmp_path / "d", 1, splits=())
    (tmp_path / "outside.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    os.remove(tmp_path / "d" / "labels" / "000000.txt")
    os.symlink(tmp_path / "outside.txt", tmp_path / "d" / "labels" / "000000.txt")
    items, _ = _list(tmp_path / "d")
    assert "outside the dataset folder" in items[0].rejected


@pytest.mark.parametrize("linked", ["labels", "images"])
def test_yolo_folders_linked_in_whole_are_followed_alike(tmp_path, linked):
    # labels/ (or images/) kept elsewhere and linked in: every labelled image keeps its boxes, none rejected.
    root = tmp_path / "d"
    demo.make_yolo_dataset(root, 8, splits=())
    os.rename(root / linked, tmp_path / f"shared-{linked}")
    os.symlink(tmp_path / f"shared-{linked}", root / linked)
    items, _ = _list(root)
    assert len(items) == 8 and not [item.rejected for item in items if item.rejected]
    labelled = {name[:6] for name in os.listdir(tmp_path / "shared-labels" if linked == "labels" else root / "labels")}
    assert labelled and all(bool(item.targets["boxes"]) == (os.path.basename(item.rel)[:6] in labelled) for item in items)


def test_a_yolo_image_file_linking_out_is_rejected_as_a_label_file_is(tmp_path):
    demo.make_yolo_dataset(tmp_path / "d", 2, splits=())
    os.rename(tmp_path / "d" / "images" / "000001.jpg", tmp_path / "elsewhere.jpg")
    os.symlink(tmp_path / "elsewhere.jpg", tmp_path / "d" / "images" / "000001.jpg")
    items, _ = _list(tmp_path / "d")
    assert not items[0].rejected
    assert items[1].rejected == "its image file images/000001.jpg leads outside the dataset folder"


@pytest.mark.parametrize("pyyaml", [True, False])
def test_yolo_nc_is_the_class_count(tmp_path, monkeypatch, pyyaml):
    import sys

    if not pyyaml:
        monkeypatch.setitem(sys.modules, "yaml", None)
    demo.make_yolo_dataset(tmp_path, 4, splits=())
    # nc without names: classes 0..nc-1 whatever ids the labels use (splits prepared apart agree)
    (tmp_path / "data.yaml").write_text("nc: 6\n")
    items, info = _list(tmp_path)
    assert info.classes == ["0", "1", "2", "3", "4", "5"] and not any(item.rejected for item in items)
    (tmp_path / "data.yaml").write_text("nc: 3\nnames: [a, b, c, d, e, f]\n")
    with pytest.raises(ConfigError, match="'nc' is 3 but 'names' lists 6 classes"):
        _list(tmp_path)
    (tmp_path / "data.yaml").write_text("nc: many\n")
    with pytest.raises(ConfigError, match="'nc' must be the number of classes"):
        _list(tmp_path)
    (tmp_path / "data.yaml").write_text("nc: 2\n")  # a label of class 2 is past the count: its image is refused
    items, _ = _list(tmp_path)
    assert any("is not one of the 2 classes" in (item.rejected or "") for item in items)


def _keys(items) -> list[str]:
    return [item.rel for item in items]


def test_yolo_splits_are_never_merged(tmp_path):
    root = demo.make_yolo_dataset(tmp_path / "d", 8)  # images/{train,val}, data.yaml with train: and val:
    for source in (root, f"{root}/data.yaml"):
        with pytest.raises(ConfigError, match="holds the splits train, val, which are separate datasets"):
            _list(source)
        train, info = _list(source, "train")
        val, _ = _list(source, "val")
        assert _keys(train) == [f"images/train/{i:06d}.jpg" for i in (0, 2, 4, 6)] and info.kind == "yolo"
        assert _keys(val) == [f"images/val/{i:06d}.jpg" for i in (1, 3, 5, 7)]
        assert any(item.targets["boxes"] for item in train + val) and not any(item.rejected for item in train + val)
        with pytest.raises(ConfigError, match="has no split 'test'; its splits: train, val"):
            _list(source, "test")
    # The folder layout alone (no data.yaml) says the same.
    os.remove(tmp_path / "d" / "data.yaml")
    with pytest.raises(ConfigError, match="holds the splits train, val"):
        _list(root)
    assert _keys(_list(root, "val")[0]) == [f"images/val/{i:06d}.jpg" for i in (1, 3, 5, 7)]


def test_a_yolo_split_folder_as_src_keeps_its_labels_and_names(tmp_path):
    root = demo.make_yolo_dataset(tmp_path / "d", 8)
    items, info = _list(f"{root}/images/train")
    assert (info.kind, info.task, info.classes) == ("yolo", "detection", ["cat", "dog", "bird"])
    assert _keys(items) == [f"images/train/{i:06d}.jpg" for i in (0, 2, 4, 6)]
    assert items == _list(root, "train")[0]


def test_a_data_yaml_split_may_be_a_list_file_or_several_folders(tmp_path):
    root = tmp_path / "d"
    demo.make_yolo_dataset(root, 8)
    (root / "train.txt").write_text("./images/train/000000.jpg\n./images/train/000004.jpg\n# a comment\n")
    (root / "data.yaml").write_text(
        "path: .\ntrain: train.txt\nval: [images/val, images/train]\ntest: images/nowhere\nnames: [cat, dog, bird]\n"
    )
    with pytest.raises(SourceError, match="'test' names .*images/nowhere, which does not exist"):
        _list(root / "data.yaml", "train")
    (root / "data.yaml").write_text("path: .\ntrain: train.txt\nval: [images/val, images/train]\nnames: [cat, dog, bird]\n")
    assert _keys(_list(root / "data.yaml", "train")[0]) == ["images/train/000000.jpg", "images/train/000004.jpg"]
    both = _list(root / "data.yaml", "val")[0]
    assert len(both) == 8 and not any(item.rejected for item in both)
    # data.yaml's path: is where its entries start (relative to the yaml's folder)
    (tmp_path / "elsewhere.yaml").write_text("path: d\ntrain: images/train\nnames: [cat, dog, bird]\n")
    assert len(_list(tmp_path / "elsewhere.yaml")[0]) == 4  # one split: no split= needed
    (tmp_path / "none.yaml").write_text("names: [cat]\n")
    with pytest.raises(ConfigError, match="names no split"):
        _list(tmp_path / "none.yaml")


def test_split_is_refused_for_a_source_without_splits(tmp_path):
    demo.make_demo_dataset(tmp_path / "raw", 4)
    with pytest.raises(ConfigError, match="split='train' is for a YOLO dataset with splits"):
        _list(tmp_path / "raw", "train")


def test_a_yolo_data_yaml_with_bad_names_is_refused(tmp_path):
    demo.make_yolo_dataset(tmp_path, 1)
    (tmp_path / "data.yaml").write_text("names: {0: a, 2: b}\n")
    with pytest.raises(ConfigError, match="ids of 'names'"):
        _list(tmp_path)
    (tmp_path / "data.yaml").write_text("names: [a, b\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        _list(tmp_path)


def test_yolo_names_parse_without_pyyaml(tmp_path, monkeypatch):
    import sys

    from pipeline.prepare.formats import detection as formats_detection

    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    for text, names in [("names: [a, 'b c']\n", ["a", "b c"]), ("names:\n  0: x\n  1: y\nnc: 2\n", ["x", "y"]), ("names:\n  - p\n  - q\n", ["p", "q"])]:
        (tmp_path / "data.yaml").write_text(text)
        assert formats_detection.yolo_names(str(tmp_path)) == names


# -- Pascal VOC --------------------------------------------------------------------


def test_voc_lists_the_boxes_the_generator_drew(tmp_path):
    root = demo.make_voc_dataset(tmp_path, 12)
    items, info = _list(root)
    assert (info.kind, info.task) == ("voc", "detection")
    for index, item in enumerate(items):
        scene, boxes, names = _scene_boxes(index)
        assert item.rel == f"JPEGImages/{index:06d}.jpg"
        assert item.targets == {"boxes": boxes, "box_labels": names, "columns": {"difficult": list(scene.crowd)},
                                "frame": "declared", "declared_size": [scene.width, scene.height]}  # fmt: skip
    _, labels = _spilled(tmp_path / "Annotations", items)
    assert class_names(info, labels) == sorted(labels)


@pytest.mark.parametrize(
    "xml, reason",
    [
        ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">]><annotation>&lol;</annotation>', "DOCTYPE"),
        ("<annotation><object><name>cat</name>", "not well-formed"),
        ("<annotation><object><name>cat</name><bndbox><xmin>a</xmin></bndbox></object></annotation>", "four finite"),
        ("<annotation><object><bndbox/></object></annotation>", "no <name>"),
        ("<annotation><object><name>c</name><bndbox><xmin>9</xmin><ymin>1</ymin><xmax>3</xmax><ymax>4</ymax></bndbox></object></annotation>", "xmax < xmin"),
        ("<annotation><object><name>c</name><bndbox><xmin>inf</xmin><ymin>1</ymin><xmax>3</xmax><ymax>4</ymax></bndbox></object></annotation>", "finite"),
    ],
)
def test_a_bad_voc_xml_rejects_its_image(tmp_path, xml, reason):
    demo.make_voc_dataset(tmp_path, 2)
    (tmp_path / "Annotations" / "000001.xml").write_text(xml)
    items, _ = _list(tmp_path)
    assert not items[0].rejected and reason in items[1].rejected


def test_a_voc_xml_in_utf16_is_refused(tmp_path):
    demo.make_voc_dataset(tmp_path, 1)
    (tmp_path / "Annotations" / "000000.xml").write_bytes('<!DOCTYPE x [<!ENTITY a "b">]><annotation/>'.encode("utf-16"))
    items, _ = _list(tmp_path)
    assert "refused" in items[0].rejected


def test_a_huge_voc_xml_is_rejected_unread(tmp_path, monkeypatch):
    from pipeline.prepare.formats import voc as formats_voc

    demo.make_voc_dataset(tmp_path, 1)
    monkeypatch.setattr(formats_voc, "ANNOTATION_MAX_BYTES", 100)
    items, _ = _list(tmp_path)
    assert "over 100 bytes" in items[0].rejected


def test_a_voc_annotation_without_its_image_is_rejected(tmp_path):
    demo.make_voc_dataset(tmp_path, 2)
    os.remove(tmp_path / "JPEGImages" / "000001.jpg")
    items, _ = _list(tmp_path)
    assert "has no image" in items[1].rejected


# -- segmentation ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["masks", "voc"])
def test_segmentation_pairs_each_image_with_its_mask(tmp_path, layout):
    import numpy as np
    from PIL import Image

    root = demo.make_segmentation_dataset(tmp_path, 6, layout=layout, palette=layout == "voc")
    items, info = _list(root)
    assert (info.kind, info.task, info.ignore_index) == ("segmentation", "segmentation", 255)
    assert info.classes == ["background", "cat", "dog", "bird"]
    assert len(items) == 6
    for index, item in enumerate(items):
        mask = np.asarray(Image.open(item.targets["mask"]))
        assert np.array_equal(mask, demo.demo_mask(demo.demo_scene(index)))
        assert os.path.splitext(os.path.basename(item.targets["mask"]))[0] == os.path.splitext(os.path.basename(item.url))[0]


@pytest.mark.parametrize("folder", ["annotations", "labels"])
def test_segmentation_takes_masks_from_annotations_or_labels(tmp_path, folder):
    demo.make_segmentation_dataset(tmp_path, 2)
    os.rename(tmp_path / "masks", tmp_path / folder)
    items, info = _list(tmp_path)
    assert info.kind == "segmentation" and items[0].targets == {"mask": str(tmp_path / folder / "000000.png")}


def test_an_image_without_a_mask_is_rejected_and_a_mask_linking_out_too(tmp_path):
    demo.make_segmentation_dataset(tmp_path / "d", 3)
    os.remove(tmp_path / "d" / "masks" / "000001.png")
    os.rename(tmp_path / "d" / "masks" / "000002.png", tmp_path / "outside.png")
    os.symlink(tmp_path / "outside.png", tmp_path / "d" / "masks" / "000002.png")
    items, _ = _list(tmp_path / "d")
    assert not items[0].rejected
    assert items[1].rejected == "no mask: expected masks/000001.png"
    assert "outside the dataset folder" in items[2].rejected


def test_voc_segmentation_ignores_the_images_it_does_not_segment(tmp_path):
    demo.make_segmentation_dataset(tmp_path, 4, layout="voc")
    os.remove(tmp_path / "SegmentationClass" / "000002.png")
    items, info = _list(tmp_path)
    assert [item.rel for item in items] == ["JPEGImages/000000.jpg", "JPEGImages/000001.jpg", "JPEGImages/000003.jpg"]
    assert info.ignored == 1


# -- WebDataset shards ------------------------------------------------------------


def test_caption_shards_list_every_caption_and_where_the_image_is(tmp_path):
    pattern = demo.make_caption_shards(tmp_path, 12, per_shard=5)
    items, info = _list(pattern)
    assert (info.kind, info.task) == ("webdataset", "captions")
    assert len(items) == 12
    for index, item in enumerate(items):
        shard, at = divmod(index, 5)
        key = f"{shard:05d}{at:04d}"
        assert item.url == str(tmp_path / f"{shard:05d}.tar") and item.rel == f"{shard:05d}.tar/{key}"
        assert item.targets["caption"] == demo.demo_caption(demo.demo_scene(index))
        assert item.targets["columns"]["key"] == key
        with tarfile.open(item.url) as archive:
            member = archive.getmember(f"{key}.jpg")
            expected = archive.extractfile(member).read()
        with open(item.url, "rb") as handle:
            handle.seek(item.targets["tar"]["offset"])
            assert handle.read(item.targets["tar"]["size"]) == expected
    folder_items, folder_info = _list(tmp_path)  # the folder: tars only, the parquet and stats files ignored
    assert folder_items == items and folder_info.ignored == 6


def _shard(path, samples):
    blob = b"".join(sample_tar_bytes(key, members) for key, members in samples) + bytes(1024)
    path.write_bytes(blob)


def test_cls_members_are_labels_and_a_sample_without_image_is_ignored(tmp_path):
    _shard(tmp_path / "a.tar", [("k1", {"png": b"P", "cls": b"dog\n"}), ("k2", {"txt": b"no image"}), ("k3", {"jpg": b"J", "json": b"[1]"})])
    items, info = _list(tmp_path / "a.tar")
    assert [(item.rel, item.label) for item in items] == [("a.tar/k1", "dog"), ("a.tar/k3", None)]
    assert items[1].targets["columns"] == {"json": [1]}
    assert info.task == "classification" and info.ignored == 1


def test_bad_text_members_and_repeated_keys_reject_their_sample(tmp_path, monkeypatch):
    from pipeline.prepare.formats import tar as formats_tar

    monkeypatch.setattr(formats_tar, "TEXT_MAX_BYTES", 10)
    _shard(tmp_path / "a.tar", [("k1", {"jpg": b"J", "txt": b"x" * 11}), ("k2", {"jpg": b"J", "json": b"{bad"}),
                                ("k3", {"jpg": b"J"}), ("k3", {"jpg": b"J"})])
    # two consecutive members of one key are one sample; split them by another key in between
    blob = (tmp_path / "a.tar").read_bytes()[:-1024] + sample_tar_bytes("k4", {"jpg": b"J"}) + sample_tar_bytes("k3", {"png": b"P"}) + bytes(1024)
    (tmp_path / "a.tar").write_bytes(blob)
    items, _ = _list(tmp_path / "a.tar")
    reasons = [item.rejected for item in items]
    assert "over 10 bytes" in reasons[0] and "not valid JSON" in reasons[1]
    assert reasons[2:4] == ["", ""] and "appears twice" in reasons[4]


def test_a_damaged_shard_is_one_rejected_item_after_its_good_samples(tmp_path):
    _shard(tmp_path / "a.tar", [("k1", {"jpg": b"J" * 600}), ("k2", {"jpg": b"J" * 600})])
    blob = bytearray((tmp_path / "a.tar").read_bytes())
    blob[1536 + 10] ^= 0xFF  # the second header's name: its checksum no longer matches
    (tmp_path / "a.tar").write_bytes(bytes(blob))
    items, _ = _list(tmp_path / "a.tar")
    assert [item.rel for item in items] == ["a.tar/k1", "a.tar"] and "damaged shard" in items[1].rejected


def test_shard_patterns(tmp_path):
    _shard(tmp_path / "s-01.tar", [("a", {"jpg": b"J"})])
    _shard(tmp_path / "s-02.tar", [("b", {"jpg": b"J"})])
    items, _ = _list(tmp_path / "s-{01..02}.tar")
    assert [item.rel for item in items] == ["s-01.tar/a", "s-02.tar/b"]
    items, _ = _list(tmp_path / "s-{02,01}.tar")
    assert [item.rel for item in items] == ["s-02.tar/b", "s-01.tar/a"]
    with pytest.raises(SourceError, match="not found"):
        _list(tmp_path / "s-{01..03}.tar")
    with pytest.raises(ConfigError, match="brace range"):
        _list(tmp_path / "s-{03..01}.tar")


def test_a_sample_cut_short_by_the_end_of_the_shard_is_not_listed(tmp_path):
    _shard(tmp_path / "a.tar", [("k1", {"jpg": b"J" * 600}), ("k2", {"jpg": b"J" * 6000})])
    (tmp_path / "a.tar").write_bytes((tmp_path / "a.tar").read_bytes()[:3000])
    items, _ = _list(tmp_path / "a.tar")
    assert [item.rel for item in items] == ["a.tar/k1", "a.tar"] and "truncated" in items[1].rejected


def test_a_tar_that_is_not_a_tar_is_a_rejected_item_not_a_traceback(tmp_path):
    (tmp_path / "x.tar").write_bytes(b"not a tar at all" * 40)
    items, _ = _list(tmp_path / "x.tar")
    assert len(items) == 1 and "damaged shard" in items[0].rejected


def test_webdataset_reads_the_demo_shards(tmp_path):
    import webdataset as wds

    pattern = demo.make_caption_shards(tmp_path, 6, per_shard=3)
    samples = list(wds.WebDataset(pattern, shardshuffle=False))
    assert [s["txt"].decode() for s in samples] == [demo.demo_caption(demo.demo_scene(i)) for i in range(6)]
    assert all(json.loads(s["json"])["status"] == "success" for s in samples)
    assert io.BytesIO(samples[0]["jpg"]).read(2) == b"\xff\xd8"


# -- the classification listing -----------------------------------------------------


def test_an_image_folder_lists_as_before(tmp_path):
    result = demo.make_demo_dataset(tmp_path, 4, classes=2, min_side=16, max_side=16, workers=1)
    items, info = _list(result.root)
    assert (info.kind, info.task) == ("imagefolder", "classification")
    assert all(item.targets is None and item.label in result.classes for item in items)
    assert [item.to_json() for item in items] == [json.dumps([item.url, item.rel, item.label]) for item in items]
