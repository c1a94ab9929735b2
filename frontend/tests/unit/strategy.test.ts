import { describe, expect, it } from "vitest";
import { buildStrategy, parseWholeNumber, suggestedDevice, usesWorkersAndBatch } from "../../src/config/strategy";

describe("suggestedDevice", () => {
  it("preselects the CPU on a server that reports no GPU, and CUDA High Performance otherwise", () => {
    expect(suggestedDevice(false)).toBe("cpu");
    expect(suggestedDevice(true)).toBe("albatross");
    expect(suggestedDevice(undefined)).toBe("albatross");
  });
});

describe("buildStrategy", () => {
  it("maps CPU to the classic backend's `cpu fp32`", () => {
    expect(buildStrategy({ device: "cpu", workers: 3, batch: 7 })).toEqual({ ok: true, strategy: "cpu fp32" });
  });

  it("maps CUDA to the classic backend's `cuda fp16`", () => {
    expect(buildStrategy({ device: "cuda", workers: 3, batch: 7 })).toEqual({ ok: true, strategy: "cuda fp16" });
  });

  it("maps CUDA High Performance to `albatross workers=N batch=M` with the typed values", () => {
    expect(buildStrategy({ device: "albatross", workers: 1, batch: 32 })).toEqual({
      ok: true,
      strategy: "albatross workers=1 batch=32",
    });
    expect(buildStrategy({ device: "albatross", workers: 8, batch: 4096 })).toEqual({
      ok: true,
      strategy: "albatross workers=8 batch=4096",
    });
  });

  it.each([
    [0, 32, "workers"],
    [9, 32, "workers"],
    [1.5, 32, "workers"],
    [Number.NaN, 32, "workers"],
    [1, 0, "batch"],
    [1, 4097, "batch"],
    [1, Number.NaN, "batch"],
  ] as const)("refuses workers=%s batch=%s and names the field %s", (workers, batch, field) => {
    const result = buildStrategy({ device: "albatross", workers, batch });
    expect(result.ok, `workers=${workers} batch=${batch} must not build a strategy`).toBe(false);
    expect(result.ok ? null : result.field).toBe(field);
  });

  it("ignores workers and batch for classic devices, where they do not apply", () => {
    expect(buildStrategy({ device: "cpu", workers: 0, batch: 0 }).ok).toBe(true);
  });
});

describe("which settings apply", () => {
  it("shows workers and batch only for CUDA High Performance", () => {
    expect([usesWorkersAndBatch("cpu"), usesWorkersAndBatch("cuda"), usesWorkersAndBatch("albatross")]).toEqual([
      false,
      false,
      true,
    ]);
  });
});

describe("parseWholeNumber", () => {
  it("reads digits, allowing surrounding spaces", () => {
    expect(parseWholeNumber(" 42 ")).toBe(42);
  });

  it.each(["", "3.5", "1e3", "-2", "abc", "4 2"])("rejects %j", (text) => {
    expect(parseWholeNumber(text)).toBeNaN();
  });
});
