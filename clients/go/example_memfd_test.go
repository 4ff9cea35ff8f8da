//go:build linux

package kvsvc_test

import (
	"context"
	"log"
	"syscall"
	"time"

	kvsvc "github.com/kvsvc/kvsvc/clients/go"
	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
)

// The README's sealed memfd example (compiled by go vet and go test; the same
// calls run against a live server in TestSealedMemfdRegion).
func ExampleClient_RegisterMemfd() {
	c, err := kvsvc.New("127.0.0.1:50051", kvsvc.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()

	fd, err := kvsvc.MakeSealedMemfd("kv-cache", 4096) // 4 blocks of 1024 bytes
	if err != nil {
		log.Fatal(err)
	}
	kv, err := syscall.Mmap(fd, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		log.Fatal(err)
	}
	defer syscall.Munmap(kv)
	token, err := c.RegisterMemfd(ctx, fd)
	syscall.Close(fd) // the server holds its own copy; kv keeps the memory
	if err != nil {
		log.Fatal(err) // e.g. *kvsvc.Unimplemented FD_PASSING_DISABLED: map a file in --shm-dir instead
	}
	m, err := c.Map(ctx, &pb.MapRequest{
		Namespace: "llama-3-8b/fp16",
		Ranks: []*pb.RankRegion{{
			Context: &pb.RankContext{TpSize: 1, PpSize: 1, GroupId: "engine-0"},
			Tensors: []*pb.KVTensor{{
				Name: "layer.0",
				Handle: &pb.MemoryHandle{Kind: &pb.MemoryHandle_SealedMemfd{
					SealedMemfd: &pb.SealedMemfdHandle{Token: token, SizeBytes: 4096}}},
				Shape: []int64{4, 1024}, Strides: []int64{1024, 1}, Dtype: pb.Dtype_DTYPE_UINT8,
			}},
		}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Unmap(ctx, m.MappingId)
	copy(kv[:1024], "block 0's KV bytes")
	blocks := func(ids ...uint32) *pb.BlockChunks {
		return &pb.BlockChunks{MappingId: m.MappingId,
			Chunks: []*pb.BlockChunk{{Key: []byte("prefix-hash-0"), BlockIds: ids}}}
	}
	if _, err := c.StoreRaw(ctx, &pb.StoreRequest{Source: &pb.StoreRequest_Blocks{Blocks: blocks(0)}}); err != nil {
		log.Fatal(err)
	}
	if _, err := c.RetrieveRaw(ctx, &pb.RetrieveRequest{Target: &pb.RetrieveRequest_Blocks{Blocks: blocks(3)}}); err != nil {
		log.Fatal(err)
	}
	// kv[3072:4096] now holds block 0's bytes.
}
