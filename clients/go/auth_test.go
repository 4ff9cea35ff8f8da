package kvsvc

// Against a real `kvsvc serve` with a tenant file: Options.Token, tenants kept
// apart, Unauthenticated and PermissionDenied as typed errors.

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

func TestTokensNameTenants(t *testing.T) {
	tokenA, tokenB := newRequestID(), newRequestID()
	dir := t.TempDir()
	file := filepath.Join(dir, "tenants.json")
	spec := map[string]any{"tenants": map[string]any{
		"a": map[string]any{"tokens": []string{tokenA}, "namespaces": []string{"a/*"}},
		"b": map[string]any{"tokens": []string{tokenB}, "namespaces": []string{"*"}},
	}}
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	s := startServer(t, "", "--auth-token-file", file)
	ctx := ctxFor(t, 30*time.Second)

	for _, token := range []string{"", newRequestID()} {
		c := newClient(t, s.addr, Options{Token: token})
		_, err := c.ServerInfo(ctx)
		if e := expect(t, err, "Unauthenticated"); e.Code != codes.Unauthenticated {
			t.Fatalf("code %v", e.Code)
		}
	}
	a := newClient(t, s.addr, Options{Token: tokenA})
	if _, err := a.Store(ctx, "a/x", []Chunk{{Key: []byte("k"), Data: []byte("secret")}}); err != nil {
		t.Fatal(err)
	}
	_, err = a.Store(ctx, "b/x", []Chunk{{Key: []byte("k"), Data: []byte("v")}})
	expect(t, err, "PermissionDenied")
	b := newClient(t, s.addr, Options{Token: tokenB})
	seen, err := b.Lookup(ctx, "a/x", [][]byte{[]byte("k")})
	if err != nil || seen.HitChunks != 0 {
		t.Fatalf("b sees a's chunk: %v err=%v", seen, err)
	}
	if _, err := New(s.addr, Options{Token: "a b"}); err == nil {
		t.Fatal("a token with whitespace was accepted")
	}
}
