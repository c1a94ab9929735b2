/** Which cells of the batch strip are on screen: only those rows are rendered (virtualisation). */

export interface StripGeometry {
  total: number;
  viewportWidth: number;
  viewportHeight: number;
  scrollTop: number;
  cellWidth: number;
  rowHeight: number;
  gap: number;
  overscanRows: number;
}

export interface StripWindow {
  columns: number;
  rows: number;
  /** Rows to render, [firstRow, endRow). */
  firstRow: number;
  endRow: number;
  /** Items the person can see, 1-based and inclusive, for the header; 0-0 when empty. */
  firstVisible: number;
  lastVisible: number;
}

export function stripWindow(geometry: StripGeometry): StripWindow {
  const { total, rowHeight } = geometry;
  const columns = Math.max(1, Math.floor((geometry.viewportWidth + geometry.gap) / (geometry.cellWidth + geometry.gap)));
  const rows = Math.ceil(total / columns);
  if (total === 0) return { columns, rows: 0, firstRow: 0, endRow: 0, firstVisible: 0, lastVisible: 0 };
  const topRow = clamp(Math.floor(geometry.scrollTop / rowHeight), 0, rows - 1);
  // A row counts as visible when any of it shows; a viewport of zero height still shows one row.
  const bottomRow = clamp(Math.ceil((geometry.scrollTop + geometry.viewportHeight) / rowHeight) - 1, topRow, rows - 1);
  return {
    columns,
    rows,
    firstRow: Math.max(0, topRow - geometry.overscanRows),
    endRow: Math.min(rows, bottomRow + 1 + geometry.overscanRows),
    firstVisible: topRow * columns + 1,
    lastVisible: Math.min(total, (bottomRow + 1) * columns),
  };
}

function clamp(value: number, low: number, high: number): number {
  return Math.min(high, Math.max(low, value));
}
