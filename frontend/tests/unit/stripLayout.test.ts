import { describe, expect, it } from "vitest";
import { stripWindow, type StripGeometry } from "../../src/batch/stripLayout";

const base: StripGeometry = {
  total: 1000,
  viewportWidth: 680, // (680 + 4) / (64 + 4) = 10 columns
  viewportHeight: 120, // 3 rows of 40
  scrollTop: 0,
  cellWidth: 64,
  rowHeight: 40,
  gap: 4,
  overscanRows: 2,
};

describe("stripWindow", () => {
  it("fits as many columns as the width allows and counts the rows", () => {
    const window = stripWindow(base);
    expect([window.columns, window.rows]).toEqual([10, 100]);
  });

  it("renders only the visible rows plus the overscan, not all 1000 items", () => {
    const window = stripWindow({ ...base, scrollTop: 40 * 50 });
    expect([window.firstRow, window.endRow]).toEqual([48, 55]);
    expect((window.endRow - window.firstRow) * window.columns).toBeLessThan(100);
  });

  it("reports the visible items for the header, 1-based", () => {
    expect(stripWindow(base)).toMatchObject({ firstVisible: 1, lastVisible: 30 });
    expect(stripWindow({ ...base, scrollTop: 40 * 10 + 20 })).toMatchObject({ firstVisible: 101, lastVisible: 140 });
  });

  it("never reports items past the end", () => {
    const window = stripWindow({ ...base, total: 25, scrollTop: 10_000 });
    expect(window).toMatchObject({ rows: 3, firstVisible: 21, lastVisible: 25, endRow: 3 });
  });

  it("has nothing to show for an empty batch", () => {
    expect(stripWindow({ ...base, total: 0 })).toMatchObject({ rows: 0, firstVisible: 0, lastVisible: 0, endRow: 0 });
  });

  it("keeps one column in a viewport narrower than a cell", () => {
    expect(stripWindow({ ...base, viewportWidth: 10, total: 3 }).columns).toBe(1);
  });
});
